// ABI version and error strings of the llm_ops HIP backend.
#include "llm_ops.h"

extern "C" uint32_t llmops_abi_version(void) { return LLMOPS_ABI_VERSION; }

extern "C" const char* llmops_error_string(int code) {
    switch (code) {
    case LLMOPS_OK:
        return "success";
    case LLMOPS_ERR_NULL_POINTER:
        return "a required pointer argument is NULL";
    case LLMOPS_ERR_NONPOSITIVE_SIZE:
        return "a size argument is zero or negative";
    case LLMOPS_ERR_INVALID_ARGUMENT:
        return "an argument is outside its documented range (see llm_ops.h)";
    case LLMOPS_ERR_LAUNCH_FAILED:
        return "the HIP kernel launch failed (no usable device, no code object for its "
               "target, or an earlier asynchronous error)";
    default:
        return "unknown llmops error code";
    }
}
