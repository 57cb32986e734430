"""Every GGUF string ds4trt uses: metadata keys, tensor names and ggml type ids (ds4's layout)."""

ARCH = "deepseek4"

# --- metadata keys (spec ds4_architecture.md §1.4) ---
KEY_BLOCK_COUNT = f"{ARCH}.block_count"
KEY_EMBD = f"{ARCH}.embedding_length"
KEY_VOCAB = f"{ARCH}.vocab_size"
KEY_HEAD = f"{ARCH}.attention.head_count"
KEY_HEAD_KV = f"{ARCH}.attention.head_count_kv"
KEY_KEY_LENGTH = f"{ARCH}.attention.key_length"
KEY_VALUE_LENGTH = f"{ARCH}.attention.value_length"
KEY_ROPE_DIMS = f"{ARCH}.rope.dimension_count"
KEY_Q_LORA = f"{ARCH}.attention.q_lora_rank"
KEY_O_LORA = f"{ARCH}.attention.output_lora_rank"
KEY_O_GROUPS = f"{ARCH}.attention.output_group_count"
KEY_EXPERTS = f"{ARCH}.expert_count"
KEY_EXPERTS_USED = f"{ARCH}.expert_used_count"
KEY_EXPERT_FF = f"{ARCH}.expert_feed_forward_length"
KEY_EXPERTS_SHARED = f"{ARCH}.expert_shared_count"
KEY_HASH_LAYERS = f"{ARCH}.hash_layer_count"
KEY_EXPERT_GROUPS = f"{ARCH}.expert_group_count"
KEY_EXPERT_GROUPS_USED = f"{ARCH}.expert_group_used_count"
KEY_WINDOW = f"{ARCH}.attention.sliding_window"
KEY_INDEX_HEADS = f"{ARCH}.attention.indexer.head_count"
KEY_INDEX_DIM = f"{ARCH}.attention.indexer.key_length"
KEY_INDEX_TOP_K = f"{ARCH}.attention.indexer.top_k"
KEY_HC = f"{ARCH}.hyper_connection.count"
KEY_SINKHORN = f"{ARCH}.hyper_connection.sinkhorn_iterations"
KEY_COMPRESS_RATIOS = f"{ARCH}.attention.compress_ratios"
KEY_SWIGLU_CLAMP = f"{ARCH}.swiglu_clamp_exp"
KEY_ROPE_ORIG_CTX = f"{ARCH}.rope.scaling.original_context_length"
KEY_ROPE_BASE = f"{ARCH}.rope.freq_base"
KEY_ROPE_SCALE = f"{ARCH}.rope.scaling.factor"
KEY_YARN_BETA_FAST = f"{ARCH}.rope.scaling.yarn_beta_fast"
KEY_YARN_BETA_SLOW = f"{ARCH}.rope.scaling.yarn_beta_slow"
KEY_COMPRESS_ROPE_BASE = f"{ARCH}.attention.compress_rope_freq_base"
KEY_EXPERT_WEIGHT_SCALE = f"{ARCH}.expert_weights_scale"
KEY_RMS_EPS = f"{ARCH}.attention.layer_norm_rms_epsilon"
KEY_HC_EPS = f"{ARCH}.hyper_connection.epsilon"
KEY_EXPERT_WEIGHTS_NORM = f"{ARCH}.expert_weights_norm"
KEY_CONTEXT_LENGTH = f"{ARCH}.context_length"
KEY_NAME = "general.name"
KEY_ARCHITECTURE = "general.architecture"
KEY_ALIGNMENT = "general.alignment"
KEY_TOKENS = "tokenizer.ggml.tokens"
KEY_MERGES = "tokenizer.ggml.merges"
KEY_TOKENIZER_MODEL = "tokenizer.ggml.model"
KEY_TOKENIZER_PRE = "tokenizer.ggml.pre"

# --- ggml type ids ds4 uses (ds4.c:888-896) ---
F32, F16, Q8_0, Q2_K, Q4_K, IQ2_XXS, I32 = 0, 1, 8, 10, 12, 16, 26
TYPE_NAMES = {F32: "F32", F16: "F16", Q8_0: "Q8_0", Q2_K: "Q2_K", Q4_K: "Q4_K", IQ2_XXS: "IQ2_XXS", I32: "I32"}
EXPERT_TYPES = (IQ2_XXS, Q2_K, Q4_K)
PLAIN_TYPES = (F16, F32)  # MTP "plain" tensors accept either

# --- tensor names ---
TOKEN_EMBD = "token_embd.weight"
OUTPUT_HC_BASE = "output_hc_base.weight"
OUTPUT_HC_FN = "output_hc_fn.weight"
OUTPUT_HC_SCALE = "output_hc_scale.weight"
OUTPUT_NORM = "output_norm.weight"
OUTPUT = "output.weight"

MTP_PREFIX = "mtp.0."


def blk(layer: int, suffix: str) -> str:
    """Name of a per-layer tensor, e.g. blk(3, 'attn_q_a.weight') -> 'blk.3.attn_q_a.weight'."""
    return f"blk.{layer}.{suffix}"


def mtp(suffix: str) -> str:
    return MTP_PREFIX + suffix
