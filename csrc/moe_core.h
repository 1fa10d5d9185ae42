/*
 * moe_core.h: the public C11 ABI of moe-core, one include for all of it.
 *
 * The ops live in one header per area, each op's CPU and CUDA entry points side by side:
 *
 *     moe_router.h      the gating linear, the top-k router, the fused router with loss extras
 *     moe_layout.h      dense routing, token dropping, permute / unpermute, chunk sorting, counts
 *     moe_balancing.h   aux-loss scores, switch aux loss, z-loss, expert bias, Sinkhorn, metrics
 *     moe_experts.h     the grouped GEMM, glu_probs, fc1 with glu_probs fused
 *     moe_types.h       status codes, dtypes, score functions, the error message
 *     tuning.h          the run-time tuning switches, read once from the environment: not ops
 *                       (no status, no workspace), each picks among kernels or launch shapes
 *                       that compute the same op
 *
 * Every op is a plain function on raw, contiguous, row-major buffers:
 *
 *     moe_status_t moe_<op>_<fwd|bwd>(outputs..., inputs..., sizes (int64_t)..., options...,
 *                                     void *workspace, size_t workspace_bytes, void *stream);
 *
 * Outputs come first, the stream last. The CPU entry points are `moe_<op>_*` and ignore `stream`
 * (pass NULL); the CUDA entry points are `moe_cuda_<op>_*`, take device pointers and a
 * `cudaStream_t` passed as `void *`, and run only in a build with CUDA (MOE_CORE_WITH_CUDA); a
 * build without it defines them too, returning MOE_ERR_UNSUPPORTED (see moe_has_cuda()).
 * Both have the same signature and the same semantics, bit for bit where the op says so.
 *
 * Workspace: an op that needs scratch on either device has a size function on both, with the same
 * arguments, `moe_<op>_workspace_size` and `moe_cuda_<op>_workspace_size` (0 where that device
 * needs none). The caller allocates that many bytes on the device and passes them; an op that
 * needs none on either device takes (NULL, 0).
 *
 * The core never allocates, never creates streams or handles (the CUDA gating linear caches one
 * cuBLAS handle per device), never synchronises with the host and never exits. On failure a
 * function returns a status other than MOE_OK and leaves a message naming the argument and its
 * bad value in a thread-local buffer, read with moe_last_error(). Sizes and indices are int64
 * throughout. An op's CPU and CUDA entry points check their arguments with the same host code
 * (csrc/checks.h), so both reject the same values with the same message; what lies in device
 * memory is checked on the CPU only (on CUDA that would need a host sync), as each op says.
 *
 * Overflow: every size the core derives from its arguments (element counts, row bounds, byte
 * counts) is computed with checked int64 arithmetic. An op whose sizes do not fit returns
 * MOE_ERR_INVALID_ARGUMENT naming the argument and its value; a *_workspace_size function, which
 * has no status to return, returns MOE_SIZE_OVERFLOW and leaves the message in moe_last_error().
 */
#ifndef MOE_CORE_H_
#define MOE_CORE_H_

#include "moe_types.h"

#include "moe_balancing.h"
#include "moe_experts.h"
#include "moe_layout.h"
#include "moe_router.h"
#include "tuning.h"

#endif /* MOE_CORE_H_ */
