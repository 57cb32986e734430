"""Triton kernels for the custom ops (one file per op).

    moe_triton.moe_forward        ds4::MoE (plugins/moe.py) on GGUF expert blocks: IQ2_XXS, Q2_K, Q4_K
    moe_triton.dequant_rows_triton  whole rows of such blocks -> float32 (a test and debugging aid)
    q8_triton.q8_matmul           x @ W.T for Q8_0 W (attention, shared expert, LM head), T = 1..16 rows, on the
                                  weight as q8_triton.split_q8 arranges it once at load
    q8_mma.q8_mma_matmul          the same on the tensor cores (CUDA C++ compiled by NVRTC, mma.sync), T = 1..16;
                                  q8_matmul's choice where it is faster (q8_mma.faster)
    f16_triton.f16_matmul         x @ W.T for an F16 matrix kept as float16 (router, compressors, indexer), T <= 16
    hc_triton.hc_pre_triton       a whole hyper-connection reduction (model/hc.py hc_pre), T = 1..16 rows;
                                  hc_pre_long_triton for prefill chunks
    hc_triton.hc_post_triton      the streams' update (model/hc.py hc_post) of a prefill chunk
    attn_triton.attend_triton     attention over given keys and mask with sinks (model/attention.py attend), T <= 16
    attn_triton.attend_long_triton  the same for prefill chunks (flash-attention style, float16 parts)
    index_triton.index_score_triton  the indexer's scores of the compressed rows (model/attention.py index_score),
                                  T <= 16; index_score_long_triton for prefill chunks
    qat_triton.indexer_qat_triton  ds4's rounding of the indexer's queries (model/numerics.py indexer_qat) in one
                                  pass, bitwise PyTorch's
    rope_triton.head_norm_rope_triton  the attention queries' per-head norm and RoPE in one pass
    rows_triton.kv_row_triton     the raw KV row of a short step (model/attention.py kv_row), T <= 16
    rows_triton.compress_emit_triton  a compressor's rows of a short step (model/attention.py emit_rows), T <= 16
    commit_triton.CommitPlan      a step's accepted cache rows written in one launch (runtime/cache.py CacheState.write)
    parts.split_parts             float32 operands as float16 hi + lo parts (prefill tensor-core inputs)

Triton is not a package dependency: these modules import it at import time, so import them only where
Triton is installed (the GPU image). Both run under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors)
for checking on a machine without a GPU.
"""
