"""Engine configuration: every knob of a served model, its one default, validated once with errors that
name the knob. The Triton models (LLM and tokenizer), the CLIs and the bench all build it here."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from .kernels import KERNEL_BACKENDS
from .kv_cache.pool import KV_CACHE_KINDS, parse_memory_budget
from .layers.linear import INT4_ACTIVATIONS, INT4A8_KERNELS
from .layers.moe import MOE_EXPERTS_QUANTS
from .contract.fields import SamplingLimits


LM_HEAD_QUANTS = ("checkpoint", "int8", "int4", "int4a8")
GREEDY_HEADS = ("auto", "int8", "off")
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class EngineConfig:
    checkpoint: str
    tokenizer: str | None = None           # folder with tokenizer files; default: the checkpoint
    device: str = "auto"                   # auto | cpu | cuda | npu (cuda:1 etc.)
    dtype: str = "bfloat16"                # compute dtype: bfloat16 | float32 (| float16 off the CPU)
    kv_cache: str = "bf16"                 # bf16 (model dtype) | tq (TurboQuant 4-bit)
    page_size: int = 128
    kv_cache_memory: str | float | int = "2GiB"   # bytes ('2GiB') or a fraction (0.3) of free memory
    max_num_seqs: int = 64
    max_model_len: int | None = None       # default: the checkpoint's positions, capped by what the KV pool holds
    max_num_batched_tokens: int = 512      # prefill chunk budget per step
    # prompt rows scored (prompt_logprobs: full-vocabulary logits per row) per step, over all sequences: a big
    # scoring request is chunked within it, the rest of the step's budget stays with the other requests
    max_scoring_tokens_per_step: int = 128
    default_max_tokens: int = 256
    max_waiting_requests: int = 256        # beyond this, new requests are refused at once (UNAVAILABLE)
    enable_prefix_caching: bool = True     # full KV pages cached by content and reused by later prompts
    scheduling_policy: str = "fcfs"        # fcfs | priority (vLLM: lower `priority` first, preempting higher)
    tq_seed: int = 0
    kernels: str = "auto"                  # auto | reference | cpu | triton | npu
    # checkpoint (the head as stored) | int8 (per channel, A8W8) | int4 (group 128, W4A16) | int4a8 (int4's codes on
    # int8 activations: llama.cpp's Q4_0 head in kind, kernels/reference/w4a8.py)
    lm_head_quant: str = "checkpoint"
    # Qwen3-MoE's routed experts: checkpoint (as stored) | int4a8 (int4 codes, zero point 8, on per-token int8
    # activations: an int4 checkpoint's own symmetric codes, float experts quantized at load, group 128; the
    # head's int4a8 arithmetic, kernels/reference/w4a8.py; the cpu and reference kernel sets)
    moe_experts_quant: str = "checkpoint"
    # an int4 checkpoint's attention projections and dense MLPs: checkpoint (W4A16: float activations) | int8 (their
    # own symmetric codes on per-token int8 activations, moe_experts_quant int4a8's arithmetic; the cpu and reference
    # kernel sets)
    int4_activations: str = "checkpoint"
    # plain-greedy rows picked through an int8 screen of the checkpoint's float head, the same tokens (half the
    # head's bytes a step: layers/greedy_head.py) | off; auto: int8 on the CPU set with lm_head_quant checkpoint
    greedy_head: str = "auto"
    kernel_cache_dir: str | None = None
    cuda_graphs: bool = True               # decode and [spec] verification from CUDA graphs (CUDA + Triton)
    num_threads: int | None = None         # default: one per core of cpu_cores, else torch's
    cpu_cores: str | None = None           # '0-3,6': the cores this engine computes on (cpu_policy.py)
    cpu_share: str | None = None           # set by the launcher: the cores shared with the other LLM models
    fault_injection: str | None = None     # test hook: "every:N" raises inside every Nth model step
    # LoRA adapters (docs/lora.md): on with enable_lora, or when lora_modules names adapters
    enable_lora: bool = False
    max_loras: int = 4                     # adapters resident at once (least recently used evicted)
    max_lora_rank: int = 16                # adapters of a higher rank are refused
    lora_modules: str | dict | None = None  # name=path pairs, or a JSON object {name: path}; + multi_lora.json
    allow_runtime_lora: bool = False       # requests may carry lora_path (an adapter loaded on first use)
    # the folders a request's lora_path may name an adapter in (comma separated, relative to the model's folder):
    # a lora_path is a folder inside one of them once every symlink is resolved; none: no lora_path is accepted
    lora_roots: str | tuple[str, ...] | None = None
    tensor_parallel_size: int = 1          # ranks the model is sharded over (backend_lib/parallel): rank 0 here
    # speculative decoding (docs/speculative.md): vLLM's --speculative-config JSON, e.g.
    # {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    speculative_config: str | dict | None = None
    limits: SamplingLimits = field(default_factory=SamplingLimits)

    @classmethod
    def from_params(cls, params: dict[str, str], base_dir: str | None = None) -> "EngineConfig":
        """From string parameters (Triton config.pbtxt); unknown names are an error naming them."""
        known = {f.name for f in fields(cls)} - {"limits"}
        limit_names = {f.name for f in fields(SamplingLimits)}
        kwargs, limits = {}, {}
        for key, raw in params.items():
            value = raw.strip() if isinstance(raw, str) else raw
            if key in limit_names:
                limits[key] = _to_int(key, value)
            elif key in known:
                kwargs[key] = value
            else:
                raise ValueError(f"parameter {key!r} is not known (known: {', '.join(sorted(known | limit_names))})")
        for key in ("page_size", "max_num_seqs", "max_num_batched_tokens", "max_scoring_tokens_per_step",
                    "default_max_tokens", "tq_seed", "max_model_len", "num_threads", "max_waiting_requests", "max_loras", "max_lora_rank",
                    "tensor_parallel_size"):
            if key in kwargs and kwargs[key] not in (None, ""):
                kwargs[key] = _to_int(key, kwargs[key])
            elif key in kwargs:
                kwargs.pop(key)
        for key in ("enable_prefix_caching", "cuda_graphs", "enable_lora", "allow_runtime_lora"):
            if key in kwargs:
                kwargs[key] = _to_bool(key, kwargs[key])
        for key in ("tokenizer", "kernel_cache_dir", "fault_injection", "cpu_cores", "cpu_share", "lora_modules",
                    "lora_roots", "speculative_config"):
            if kwargs.get(key) == "":
                kwargs.pop(key)
        if kwargs.get("speculative_config"):   # a draft model's folder, relative to the model's as the checkpoint
            from .spec.config import resolve_model_path

            kwargs["speculative_config"] = resolve_model_path(kwargs["speculative_config"], base_dir)
        cfg = cls(**kwargs, limits=SamplingLimits(**limits))
        cfg.validate()
        return cfg.resolve_locations(base_dir)

    def resolve_locations(self, base_dir: str | None = None) -> "EngineConfig":
        """checkpoint and tokenizer as local folders: a folder (relative to base_dir) stays one, a Hugging
        Face id (org/name[@revision]) is fetched into the Hub cache (backend_lib.checkpoint.hub)."""
        from .checkpoint.hub import resolve

        self.checkpoint = resolve(self.checkpoint, "checkpoint", base_dir)
        if self.tokenizer:
            self.tokenizer = resolve(self.tokenizer, "tokenizer", base_dir)
        if self.lora_modules:
            from .lora.registry import parse_lora_modules

            self.lora_modules = {name: resolve(path, f"lora_modules.{name}", base_dir)
                                 for name, path in parse_lora_modules(self.lora_modules).items()}
        if self.lora_roots:
            from .lora.registry import parse_lora_roots

            self.lora_roots = parse_lora_roots(self.lora_roots, base_dir)
        return self

    @property
    def speculative(self):
        """The validated speculative_config (backend_lib.spec.SpeculativeConfig), None when off."""
        from .spec.config import parse_speculative_config

        return parse_speculative_config(self.speculative_config)

    @property
    def lora_enabled(self) -> bool:
        return bool(self.enable_lora or self.lora_modules or self.allow_runtime_lora)

    def validate(self) -> "EngineConfig":
        if not self.checkpoint:
            raise ValueError("checkpoint: no checkpoint folder configured")
        if self.kv_cache not in KV_CACHE_KINDS:
            raise ValueError(f"kv_cache: {self.kv_cache!r} is not one of {', '.join(KV_CACHE_KINDS)}")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "max_scoring_tokens_per_step",
                     "default_max_tokens", "max_waiting_requests"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.page_size > 1024 or self.page_size % 16:
            raise ValueError(f"page_size: a multiple of 16 up to 1024, got {self.page_size}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len: must be > 1, got {self.max_model_len}")
        if self.lm_head_quant not in LM_HEAD_QUANTS:
            raise ValueError(f"lm_head_quant: {self.lm_head_quant!r} is not one of {', '.join(LM_HEAD_QUANTS)}")
        # the int4-on-int8-activations settings: one rank (the ranks load the checkpoint's weights as stored), the
        # kernel sets with the w4a8 arithmetic
        for name, values in (("moe_experts_quant", MOE_EXPERTS_QUANTS), ("int4_activations", INT4_ACTIVATIONS)):
            value = getattr(self, name)
            if value not in values:
                raise ValueError(f"{name}: {value!r} is not one of {', '.join(values)}")
            if value != "checkpoint" and self.tensor_parallel_size > 1:
                raise ValueError(f"{name}: {value} is not supported with tensor_parallel_size > 1 (the ranks load "
                                 "the checkpoint's weights as stored); use checkpoint")
            if value != "checkpoint" and self.kernels not in ("auto",) + INT4A8_KERNELS:
                raise ValueError(f"{name}: {value} runs on the {' and '.join(INT4A8_KERNELS)} kernel sets, not "
                                 f"{self.kernels!r}")
        if self.greedy_head not in GREEDY_HEADS:
            raise ValueError(f"greedy_head: {self.greedy_head!r} is not one of {', '.join(GREEDY_HEADS)}")
        if self.greedy_head == "int8" and self.lm_head_quant != "checkpoint":
            raise ValueError(f"greedy_head: int8 screens the checkpoint's float head; lm_head_quant is "
                             f"{self.lm_head_quant!r} (the head is quantized itself)")
        if self.greedy_head == "int8" and self.tensor_parallel_size > 1:
            raise ValueError("greedy_head: int8 is not supported with tensor_parallel_size > 1 (each rank holds "
                             "a slice of the head); use auto or off")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy: {self.scheduling_policy!r} is not one of "
                             f"{', '.join(SCHEDULING_POLICIES)}")
        if self.kernels not in KERNEL_BACKENDS:
            raise ValueError(f"kernels: {self.kernels!r} is not one of {', '.join(KERNEL_BACKENDS)}")
        parse_memory_budget(self.kv_cache_memory)
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError(f"num_threads: must be positive, got {self.num_threads}")
        if self.cpu_cores:
            from .cpu_policy import parse_cores
            parse_cores(self.cpu_cores)
        if self.cpu_share:
            from .cpu_policy import parse_share
            parse_share(self.cpu_share)
        if self.fault_injection:
            fault_every(self.fault_injection)
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.lora_modules:
            from .lora.registry import parse_lora_modules

            parse_lora_modules(self.lora_modules)
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ValueError(f"tensor_parallel_size: must be in [1, 64], got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1:
            for name, on in (("cpu_share", bool(self.cpu_share)),):
                if on:
                    raise ValueError(f"tensor_parallel_size: {self.tensor_parallel_size} with {name} is not "
                                     "supported yet (use tensor_parallel_size: 1)")
        _ = self.speculative   # parsing is the validation: errors name speculative_config.<key>
        return self

    @classmethod
    def field_names(cls) -> set[str]:
        """Every parameter name a model config may set (engine fields and request limits)."""
        return ({f.name for f in fields(cls)} - {"limits"}) | {f.name for f in fields(SamplingLimits)}


def fault_every(spec: str) -> int:
    """'every:N' -> N (the fault-injection test hook)."""
    kind, _, n = spec.partition(":")
    if kind != "every" or not n.isdigit() or int(n) < 1:
        raise ValueError(f"fault_injection: {spec!r} is not 'every:N' with N >= 1")
    return int(n)


def _to_bool(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"{name}: {value!r} is not a boolean (true or false)")


def _to_int(name: str, value) -> int:
    try:
        return int(str(value).strip())
    except ValueError:
        raise ValueError(f"{name}: {value!r} is not an integer") from None

