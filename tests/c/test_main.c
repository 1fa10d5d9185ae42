/* test_main.c: runs every registered C test and prints the closing tally. */
#include <stdlib.h>

#include "ctest.h"

int ctest_failures = 0;
int ctest_checks = 0;

#define MAX_CASES 256
static ctest_case cases[MAX_CASES];
static int num_cases = 0;

void ctest_add(const char *name, ctest_fn fn) {
    if (num_cases < MAX_CASES) cases[num_cases++] = (ctest_case){name, fn};
}

void ctest_register_router(void);
void ctest_register_common(void);
void ctest_register_layout(void);
void ctest_register_balancing(void);
void ctest_register_grouped_gemm(void);
void ctest_register_exp_poly(void);
void ctest_register_overflow(void);
void ctest_register_tuning(void);

int main(void) {
    ctest_register_common();
    ctest_register_router();
    ctest_register_layout();
    ctest_register_balancing();
    ctest_register_grouped_gemm();
    ctest_register_exp_poly();
    ctest_register_overflow();
    ctest_register_tuning();
    int passed = 0, failed = 0;
    for (int i = 0; i < num_cases; ++i) {
        int before = ctest_failures;
        cases[i].fn();
        if (ctest_failures == before) {
            ++passed;
        } else {
            ++failed;
            fprintf(stderr, "FAILED %s\n", cases[i].name);
        }
    }
    printf("C core: %d checks\n", ctest_checks);
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
