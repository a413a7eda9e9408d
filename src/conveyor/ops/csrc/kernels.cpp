// The matmul and prefill-attention kernels as one translation unit: the torch headers they
// share take ~15 s to parse, once here instead of once per file. cpu_ops.cpp is the build's
// other unit (compiled beside this one: a first start on two cores takes about as long as
// the longer of the two).
#include "quant_linear.cpp"
#include "dot_linear.cpp"
#include "dot_blocks.cpp"
#include "vnni_blocks.cpp"
#include "f32_linear.cpp"
#include "prefill_attention.cpp"
