"""The architecture's hyperparameters (`ModelConfig`) and their spelling in a Hugging Face config.json.

    config = ModelConfig.from_hf(json.load(open("config.json")))   # qwen3 | qwen3_5 (text) | llama
    d = config.to_hf()                                             # what save() writes back

model.py builds a `Transformer` from a ModelConfig and re-exports it (`model.ModelConfig`);
checkpoint_io.save writes `config.to_hf()` as a checkpoint's config.json. `from_hf` refuses, with a one-line
ValueError, what the model does not implement (another model_type, rope scaling, an activation other
than silu); `__post_init__` checks that the shapes fit together. This module imports no other
module of the project.
"""

from dataclasses import dataclass

SUPPORTED = {"qwen3": "qwen3", "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "llama": "llama"}
HF_NAMES = {"qwen3": ("qwen3", "Qwen3ForCausalLM"), "qwen3_5": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
            "llama": ("llama", "LlamaForCausalLM")}


@dataclass
class ModelConfig:
    arch: str                      # "qwen3" | "qwen3_5" | "llama"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int                 # query heads of full-attention layers
    num_kv_heads: int              # key/value heads (GQA: num_heads % num_kv_heads == 0)
    head_dim: int
    intermediate_size: int         # SwiGLU hidden width
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_seq_len: int = 4096        # the model's context (max_position_embeddings)
    tie_word_embeddings: bool = False
    layer_types: list = None       # per layer "full_attention" | "linear_attention"
    partial_rotary_factor: float = 1.0   # fraction of head_dim that RoPE rotates (qwen3_5: 0.25)
    attention_bias: bool = False
    mlp_bias: bool = False
    # qwen3_5 Gated DeltaNet ("linear_attention" layers)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4
    # token ids, kept so save() writes a config transformers' generate understands
    bos_token_id: int = None
    eos_token_id: int = None
    pad_token_id: int = None

    def __post_init__(self):
        assert self.arch in HF_NAMES, f"arch must be one of {sorted(HF_NAMES)}, got {self.arch!r}"
        if self.layer_types is None:
            self.layer_types = (["linear_attention"] * 3 + ["full_attention"]) * (self.num_layers // 4) \
                if self.arch == "qwen3_5" else ["full_attention"] * self.num_layers
        assert len(self.layer_types) == self.num_layers, \
            f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
        assert self.num_heads % self.num_kv_heads == 0, \
            f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}"
        if "linear_attention" in self.layer_types:
            assert self.arch == "qwen3_5", "linear_attention layers exist only in qwen3_5"
            assert self.linear_num_value_heads % self.linear_num_key_heads == 0, \
                "linear_num_value_heads must be a multiple of linear_num_key_heads"

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        """Read a Hugging Face config.json dict (multimodal Qwen3.5: its nested `text_config`)."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED)}")
        if "text_config" in d:  # multimodal Qwen3.5: keep the text part; the outer config decides tying (as in HF)
            d = {**d["text_config"], "tie_word_embeddings": d.get("tie_word_embeddings",
                                                                  d["text_config"].get("tie_word_embeddings", False))}
        arch = SUPPORTED[model_type]
        # transformers 5 nests rope settings in rope_parameters; older files keep rope_theta at the top
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported (only 'default')")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
        num_heads = d["num_attention_heads"]
        layer_types = d.get("layer_types")
        if arch == "qwen3_5" and layer_types is None:
            every = d.get("full_attention_interval", 4)
            layer_types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                           for i in range(d["num_hidden_layers"])]
        if arch != "qwen3_5":
            layer_types = None  # qwen3's layer_types may say "sliding_attention"; we run full attention
        eos = d.get("eos_token_id")
        return cls(
            arch=arch, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            num_layers=d["num_hidden_layers"], num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            intermediate_size=d["intermediate_size"], rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", d.get("rope_theta", 10000.0)),
            max_seq_len=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=d.get("tie_word_embeddings", False), layer_types=layer_types,
            partial_rotary_factor=rope.get("partial_rotary_factor",
                                           d.get("partial_rotary_factor", 0.25 if arch == "qwen3_5" else 1.0)),
            attention_bias=d.get("attention_bias", False), mlp_bias=d.get("mlp_bias", False),
            linear_num_key_heads=d.get("linear_num_key_heads", 0),
            linear_num_value_heads=d.get("linear_num_value_heads", 0),
            linear_key_head_dim=d.get("linear_key_head_dim", 0),
            linear_value_head_dim=d.get("linear_value_head_dim", 0),
            linear_conv_kernel=d.get("linear_conv_kernel_dim", 4),
            bos_token_id=d.get("bos_token_id"), eos_token_id=eos[0] if isinstance(eos, list) else eos,
            pad_token_id=d.get("pad_token_id"))

    def to_hf(self) -> dict:
        """The config.json that transformers' AutoModelForCausalLM reads back into the same model."""
        model_type, cls_name = HF_NAMES[self.arch]
        d = dict(model_type=model_type, architectures=[cls_name], vocab_size=self.vocab_size,
                 hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
                 num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                 head_dim=self.head_dim, intermediate_size=self.intermediate_size, hidden_act="silu",
                 rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_seq_len,
                 tie_word_embeddings=self.tie_word_embeddings, attention_bias=self.attention_bias,
                 rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
                 bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id)
        if self.arch == "llama":
            d["mlp_bias"] = self.mlp_bias
        if self.arch == "qwen3_5":
            d["rope_parameters"]["partial_rotary_factor"] = self.partial_rotary_factor
            d.update(layer_types=self.layer_types, linear_num_key_heads=self.linear_num_key_heads,
                     linear_num_value_heads=self.linear_num_value_heads,
                     linear_key_head_dim=self.linear_key_head_dim,
                     linear_value_head_dim=self.linear_value_head_dim,
                     linear_conv_kernel_dim=self.linear_conv_kernel)
        return d
