/*
 * ctest.h: a minimal test harness for the C core (no torch, no Python).
 *
 * CHECK records a failure and keeps going, so one run reports every broken case; main() prints
 * the closing "N passed, N failed" line that CI reads.
 */
#ifndef MOE_CTEST_H_
#define MOE_CTEST_H_

#include <math.h>
#include <stdio.h>

extern int ctest_failures;
extern int ctest_checks;

#define CHECK(cond, ...)                                             \
    do {                                                             \
        ++ctest_checks;                                              \
        if (!(cond)) {                                               \
            ++ctest_failures;                                        \
            fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                            \
            fprintf(stderr, "\n");                                   \
        }                                                            \
    } while (0)

typedef void (*ctest_fn)(void);
typedef struct {
    const char *name;
    ctest_fn fn;
} ctest_case;

void ctest_add(const char *name, ctest_fn fn);

/* deterministic pseudo-random numbers (xorshift) so C tests need no seed plumbing */
static inline unsigned long long ctest_rand_u64(unsigned long long *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}
static inline double ctest_rand_uniform(unsigned long long *s) {
    return (double)(ctest_rand_u64(s) >> 11) * (1.0 / 9007199254740992.0);
}
static inline double ctest_rand_normal(unsigned long long *s) {
    double u1 = ctest_rand_uniform(s) + 1e-300, u2 = ctest_rand_uniform(s);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

#endif
