"""The one configuration of muxd: frozen dataclasses grouped by concern (model, cache, scheduler, runtime, parallel,
server).

Every field is a `muxd serve` flag of the same name (vLLM's name where vLLM has the concept); `config_flags.py` makes
the typer parameters from the fields, so the flags, the config and `muxd bench --serve-args` never drift apart. Cheap
checks run when a group is built; `Config.check()` does the ones that read files (model directory, SLO contract,
latency profile, chat template) before anything slow. The contract and the profile are parsed once, here, and the
loaded objects travel with the config.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from appliance.attention import BACKEND_NAMES, DECODE_KERNELS
from appliance.errors import ApplianceError, ConfigError, ModelLoadError
from appliance.model_zoo.config import ModelConfig, parse_dtype
from appliance.model_zoo.hub_cache import is_model_id, local_model_dir, not_found
from appliance.model_zoo.loader import LOAD_FORMATS, checkpoint_files, resolve_model_dir
from appliance.model_zoo.tokenizer import (TEMPLATE_VARIABLES, read_sampling_defaults, read_tokenizer_config,
                                           sampling_defaults)
from appliance.predictor.profile import ProfileFile, read_profile
from appliance.slo.contract import Contract, default_contract, load_contract

DECODE_BLAS = ("cublaslt", "cublas")  # --decode-blas: the library the decode graphs' GEMMs come from

EMBEDDED_MODEL_DIR = Path(__file__).resolve().parent / "model_zoo" / "embedded"
EMBEDDED_NAME = "muxd-embedded"
POLICIES = ("mux", "chunked", "serial", "layerwise", "pdmux")  # engine/planners/registry.py builds each
POLICY_CHOICES = ("auto", *POLICIES)  # auto: mux on a CUDA GPU, serial on a CPU
DEFAULT_GRAPH_ROWS = 2048  # --prefill-graph-rows' default for a layer of Llama-3.1-8B's size or larger
REFERENCE_LAYER_PARAMS = 218_112_000  # one decoder layer of Llama-3.1-8B
SPATIAL_POLICIES = ("mux", "layerwise", "pdmux")  # the policies that run prefill and decode on disjoint SM partitions
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "pythonic", "none")  # server/tools.py reads each
REASONING_PARSERS = ("none", "qwen3", "deepseek_r1")  # server/reasoning.py reads each
ALLOW_LONG_CONTEXT = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"  # vLLM's override of the check on --max-model-len
_LIST_EXAMPLE = """write a JSON list of strings, e.g. '["https://app.example.com"]' or '["*"]'"""
TOKENIZER_MODES = ("auto", "hf")  # --tokenizer-mode: both are the fast tokenizer of tokenizer.json, muxd's own
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")  # vLLM's --logprobs-mode
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40, "ki": 2**10,
          "mi": 2**20, "gi": 2**30, "ti": 2**40}


def default_graph_rows(model: ModelConfig | None = None) -> int:
    """--prefill-graph-rows' default for a model (one rank's share of it): DEFAULT_GRAPH_ROWS for a layer of the 8B's
    size or larger (unknown: the same); for a smaller layer, the largest power of two up to DEFAULT_GRAPH_ROWS times
    the 8B's layer over this one, so that a prefill runs eagerly only where a layer's GPU time is about the 8B's at
    2048 rows, long enough to hide the host's eager launch of it. A smaller layer's activations are smaller too, so the
    graphs' memory stays about the 8B's (Qwen2.5-0.5B: 8192 rows, at most a step's prefill tokens)."""
    if model is None or model.layer_params >= REFERENCE_LAYER_PARAMS:
        return DEFAULT_GRAPH_ROWS
    scaled = DEFAULT_GRAPH_ROWS * REFERENCE_LAYER_PARAMS // max(1, model.layer_params)
    return 1 << (scaled.bit_length() - 1)


def parse_size(text: str, flag: str = "--kv-cache-memory") -> int:
    """'4GiB', '512MB', plain integers -> bytes."""
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"{flag}: cannot read {text!r} as a size; write e.g. 4GiB, 512MiB or 1073741824")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def json_list(text: str, flag: str) -> list[str]:
    """A flag given as a JSON list of strings (vLLM's --allowed-origins and the like), or a ConfigError naming it."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag}: cannot read {text!r} as JSON ({exc.msg}); {_LIST_EXAMPLE}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{flag}: {text!r} is not a JSON list of strings; {_LIST_EXAMPLE}")
    return value


def json_object(text: str, flag: str, of: str) -> dict[str, Any]:
    """A flag given as a JSON object (of `of`, e.g. config.json fields), or a ConfigError naming it."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag}: cannot read {text!r} as JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag}: expected a JSON object of {of}, got {text!r}")
    return value


def flag(default: Any, help: str, *names: str, envvar: str | None = None, hidden: bool = False) -> Any:
    """A config field that is also a `muxd serve` flag: `names` are extra spellings (the field's own,
    --field-name, always comes first)."""
    return field(default=default, metadata={"help": help, "names": names, "envvar": envvar, "hidden": hidden})


def at_least(group: Any, minimum: float, *names: str) -> None:
    """Refuse any of the group's fields `names` below `minimum` (None passes), naming its flag."""
    for name in names:
        value = getattr(group, name)
        if value is not None and value < minimum:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {minimum:g}, got {value}")


@dataclass(frozen=True)
class ModelSettings:
    model: str = flag("embedded", "Hugging Face model directory (config.json, safetensors, tokenizer.json), a "
                      "Hugging Face id whose snapshot is in the local Hugging Face cache (nothing is downloaded), "
                      "or 'embedded' for the small model shipped inside muxd.", "-m")
    served_model_name: Optional[list[str]] = flag(None, "Model name clients send in 'model' (default: the "
                                                  "directory name, the id, or muxd-embedded); several names, as vLLM's "
                                                  "`--served-model-name a b`, are aliases: /v1/models lists them "
                                                  "all, a response names the one its request sent, metrics the "
                                                  "first.")
    revision: Optional[str] = flag(None, "With a Hugging Face id: the revision to serve from the local Hugging Face "
                                   "cache (a branch or tag the cache has a ref for, or a commit; default main). "
                                   "muxd downloads nothing.")
    download_dir: Optional[str] = flag(None, "With a Hugging Face id: the Hugging Face cache to find it in (default "
                                       "$HF_HUB_CACHE, $HF_HOME/hub or ~/.cache/huggingface/hub), as vLLM's "
                                       "--download-dir. muxd downloads nothing.")
    dtype: str = flag("auto", "Weights and KV dtype: auto (checkpoint's on GPU, float32 on CPU), bfloat16, "
                      "float16, float32.")
    load_format: str = flag("auto", "auto/safetensors reads the weights; dummy draws random ones of the right "
                            "shapes (for benchmarking without a checkpoint).")
    max_model_len: Optional[int] = flag(None, "Prompt + output tokens per request (default: the model's limit, "
                                        "capped by the KV cache; above the model's limit only with "
                                        "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, as vLLM).")
    chat_template: Optional[str] = flag(None, "Chat template to use instead of the model's: a file, or the jinja "
                                        "template itself.")
    default_chat_template_kwargs: Optional[str] = flag(None, "JSON object of chat template variables that every chat "
                                                       "request gets where its chat_template_kwargs do not set them, "
                                                       "as vLLM's flag (e.g. '{\"enable_thinking\": false}' for "
                                                       "Qwen3).")
    special_tokens_in_messages: bool = flag(False, "Read control tokens written inside chat messages (e.g. "
                                            "<|im_end|>) as the control tokens themselves, as transformers' "
                                            "apply_chat_template does. Off: they are tokenized as plain text, so a "
                                            "user cannot close their turn and forge a system turn.")
    seed: Optional[int] = flag(None, "Seed the sampling generator once at start-up, as vLLM does: the same requests "
                               "in the same order sample the same tokens. A request's own 'seed' fixes its output "
                               "regardless.")
    generation_config: str = flag("auto", "Defaults of the sampling fields a request leaves unset, as vLLM's flag: "
                                  "auto takes the temperature, top_p, top_k, min_p, repetition_penalty and "
                                  "max_new_tokens (as chat's max_tokens) that the model's generation_config.json "
                                  "recommends; a directory, those of its generation_config.json; vllm, none "
                                  "(temperature 1, no cuts, max_tokens what the context leaves).")
    hf_overrides: Optional[str] = flag(None, "JSON object of config.json fields that replace the model's, as vLLM's "
                                       "flag (top-level fields, each replaced whole), e.g. '{\"rope_scaling\": "
                                       "{\"rope_type\": \"yarn\", \"factor\": 4.0, "
                                       "\"original_max_position_embeddings\": 32768}}' for a longer context.")
    rope_scaling: Optional[str] = flag(None, "As older vLLM's: JSON of config.json's rope_scaling (--hf-overrides "
                                       "with that field).", hidden=True)
    rope_theta: Optional[float] = flag(None, "As older vLLM's: config.json's rope_theta (--hf-overrides with that "
                                       "field).", hidden=True)
    override_generation_config: Optional[str] = flag(None, "JSON of generation config fields that replace or add to "
                                                     "--generation-config's defaults (as vLLM's flag), e.g. "
                                                     "'{\"temperature\": 0.5}'; with --generation-config vllm, the "
                                                     "only defaults.")
    logprobs_mode: str = flag("raw_logprobs", "What logprobs report, as vLLM's flag: raw_logprobs (the model's own "
                              "distribution, before penalties, biases, masks and temperature; after a grammar's mask, "
                              "as vLLM's), raw_logits, "
                              "processed_logprobs (the distribution sampled from: after them and the top-k, top-p "
                              "and min-p cuts) or processed_logits. Prompt logprobs are always raw.")

    def config_overrides(self) -> dict[str, Any]:
        """The config.json fields --hf-overrides replaces, with older vLLM's --rope-scaling and --rope-theta among
        them (empty without)."""
        out = {} if self.hf_overrides is None else json_object(self.hf_overrides, "--hf-overrides",
                                                                 "config.json fields")
        older: dict[str, Any] = {}
        if self.rope_scaling is not None:
            older["rope_scaling"] = json_object(self.rope_scaling, "--rope-scaling", "rope scaling fields")
        if self.rope_theta is not None:
            older["rope_theta"] = self.rope_theta
        for key, value in older.items():
            if key in out and out[key] != value:
                raise ConfigError(f"--{key.replace('_', '-')} and --hf-overrides set {key} differently; give one")
            out[key] = value
        return out

    def template_defaults(self) -> dict[str, Any]:
        """--default-chat-template-kwargs as a dict (empty without)."""
        if self.default_chat_template_kwargs is None:
            return {}
        value = json_object(self.default_chat_template_kwargs, "--default-chat-template-kwargs",
                            "template variables")
        taken = sorted(set(value) & set(TEMPLATE_VARIABLES))
        if taken:
            raise ConfigError(f"--default-chat-template-kwargs may not set {', '.join(taken)} (muxd sets "
                              f"{', '.join(TEMPLATE_VARIABLES)} itself)")
        return value

    def __post_init__(self) -> None:
        names = self.served_model_name
        if names is not None:  # one name (a string) or several; kept as a tuple, empty meaning none given
            names = (names,) if isinstance(names, str) else tuple(names)
            if any(not isinstance(n, str) or not n.strip() for n in names):
                raise ConfigError(f"--served-model-name: every name must be non-empty text, got {list(names)!r}")
            object.__setattr__(self, "served_model_name", names or None)
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.revision is not None and (not is_model_id(self.model) or Path(self.model).expanduser().exists()):
            raise ConfigError(f"--revision {self.revision}: muxd serves the model directory as it is and downloads "
                              "nothing; a revision is read from the local Hugging Face cache only for a model given "
                              "by its id (owner/name)")
        self.template_defaults()  # (refuses what is not a JSON object of variables the request may set)
        if self.generation_config not in ("auto", "vllm") and not Path(self.generation_config).expanduser().is_dir():
            raise ConfigError(f"--generation-config must be auto, vllm or a directory holding a "
                              f"generation_config.json, got {self.generation_config!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"--logprobs-mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.dtype != "auto":
            parse_dtype(self.dtype, "--dtype")
        at_least(self, 2, "max_model_len")
        self.generation_overrides()  # readable, and only sampling fields in range
        self.config_overrides()  # a JSON object, and the older flags agree with it

    @property
    def model_dir(self) -> Path:
        """The model's directory: 'embedded', a path, or a hub id's snapshot in the local Hugging Face cache (at
        --revision, in --download-dir); an id not cached stays as given (the loader says it is missing)."""
        if self.model == "embedded":
            return EMBEDDED_MODEL_DIR
        return local_model_dir(self.model, self.revision, self.download_dir)

    @property
    def generation_config_dir(self) -> Path | None:
        """Where the sampling defaults come from (--generation-config); None: nowhere."""
        if self.generation_config == "vllm":
            return None
        return self.model_dir if self.generation_config == "auto" else Path(self.generation_config).expanduser()

    def generation_overrides(self) -> dict[str, float | int]:
        """--override-generation-config as request field -> value."""
        if self.override_generation_config is None:
            return {}
        flag = "--override-generation-config"
        values = json_object(self.override_generation_config, flag, "generation config fields")
        try:
            return sampling_defaults(values, flag, overrides=True)
        except ApplianceError as exc:
            raise ConfigError(str(exc)) from None

    def sampling_defaults(self) -> dict[str, float | int]:
        """What a request leaves unset samples with: --generation-config's defaults, then the overrides."""
        where = self.generation_config_dir
        return {**(read_sampling_defaults(where) if where is not None else {}), **self.generation_overrides()}

    @property
    def model_name(self) -> str:
        """The served model's name (the first of several)."""
        return self.served_names[0]

    @property
    def served_names(self) -> tuple[str, ...]:
        """The names /v1/models lists, the first the model's own."""
        if self.served_model_name:
            return tuple(self.served_model_name)
        if self.model == "embedded":
            return (EMBEDDED_NAME,)
        path = self.model_dir
        if path != Path(self.model).expanduser():
            return (self.model,)  # a hub id found in the cache: as vLLM names it
        return (path.resolve().name,)

    @property
    def accepted_names(self) -> tuple[str, ...]:
        """What clients may send in 'model': the served names; without --served-model-name also the model as given
        (vLLM's default name, e.g. a path), so that clients of `vllm serve PATH` need no change."""
        if self.served_model_name or self.model in ("embedded", *self.served_names):
            return self.served_names
        return (*self.served_names, self.model)

    def chat_template_source(self) -> str | None:
        """--chat-template names a file, or is the template itself (inline jinja), as in vLLM."""
        if self.chat_template is None:
            return None
        value = str(self.chat_template)
        try:
            path = Path(value).expanduser()
            if path.is_file():
                return path.read_text()
        except OSError:  # an inline template can be too long to be a file name
            pass
        if "{{" in value or "{%" in value:
            return value
        raise ConfigError(f"--chat-template {value!r}: no such file, and not a jinja template either")


@dataclass(frozen=True)
class CacheSettings:
    block_size: int = flag(16, "Tokens per KV-cache page.")
    kv_cache_memory: Optional[str] = flag(None, "KV-cache size, e.g. 8GiB, or bytes as vLLM's "
                                          "--kv-cache-memory-bytes (default: what --gpu-memory-utilization leaves "
                                          "on GPU, 512MiB on CPU).", "--kv-cache-memory-bytes")
    num_gpu_blocks_override: Optional[int] = flag(None, "KV-cache pages, overriding the size from memory (for "
                                                  "tests and experiments).", hidden=True)
    gpu_memory_utilization: float = flag(0.9, "Fraction of the GPU's memory this server may use, as vLLM's: what "
                                         "other processes hold is not counted (two servers at 0.45 share a GPU).")
    enable_prefix_caching: bool = flag(True, "Reuse KV pages of equal prompt prefixes.",
                                       "--prefix-caching/--no-prefix-caching")

    def __post_init__(self) -> None:
        at_least(self, 1, "block_size", "num_gpu_blocks_override")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None:
            parse_size(self.kv_cache_memory)

    @property
    def kv_cache_bytes(self) -> int | None:
        return parse_size(self.kv_cache_memory) if self.kv_cache_memory is not None else None


@dataclass(frozen=True)
class SchedulerSettings:
    policy: str = flag("auto", "Scheduling policy: mux (SLO-aware multiplexing), chunked (Sarathi-style token "
                       "budget, the vLLM/SGLang default), serial (prefill first), layerwise, pdmux (SGLang's "
                       "PD-multiplexing policy), or auto: mux on a CUDA GPU, serial on a CPU.", "--planner")
    max_num_seqs: int = flag(256, "Requests prefilling or decoding at once.")
    max_num_batched_tokens: int = flag(8192, "Prompt tokens prefilled per engine step, or per layer-wise pass (a "
                                       "longer prompt prefills in chunks of this many: the memory for activations "
                                       "is sized for it); chunked's budget unless --chunk-budget or --profile sets "
                                       "it.")
    max_waiting: int = flag(4096, "Queued requests beyond which new ones get HTTP 429.")
    chunk_budget: Optional[int] = flag(None, "Tokens per step for --policy chunked (default: with --profile, the "
                                       "largest whose step meets the contract's TBT target; without, "
                                       "--max-num-batched-tokens).")
    slo: Optional[str] = flag(None, "SLO contract (YAML, see configs/slo/); default: p99 TBT 50 ms.")
    profile: Optional[str] = flag(None, "Latency profile of this model on this GPU for --policy mux (and chunked's "
                                  "budget); unset, mux uses the one `muxd profile` cached for this model and GPU, or "
                                  "one shipped with muxd, else the roofline prior (the closed loop keeps it safe).")
    prefill_pause: bool = flag(True, "mux: a short prompt may pause a long prefill batch between layers and run "
                               "first.", "--preemption/--no-preemption")
    mixed_chunks: bool = flag(False, "mux: run a chunk of the prompt beside the decode rows on all SMs, sized to "
                              "the TBT target, whenever the profile predicts it prefills faster than the SM split.")
    temporal_prefill: bool = flag(True, "mux: run decode on all SMs and then as many prefill layers on all SMs as "
                                  "the TBT target leaves room for, whenever the profile predicts that prefills "
                                  "faster than the SM split (no split penalty, no contention between the phases); "
                                  "--no-temporal-prefill keeps prefill on the split.")
    layers_per_step: int = flag(1, "layerwise: prefill layers advanced per step.")
    layerwise_decode_sms: int = flag(64, "layerwise: SMs decode gets while prefill runs.")
    pdmux_sm_groups: int = flag(8, "pdmux: stream groups fixed at start-up (SGLang's sm_group_num): all-prefill, "
                                "all-decode and the SM splits between.")
    pdmux_divisions: Optional[str] = flag(None, "pdmux: SGLang's manual_divisions, PREFILL_SMS:DECODE_SMS:MIN_BATCH,"
                                          "... (--pdmux-sm-groups minus 2 of them); default: SGLang's own rule.")
    pdmux_bs_divisor: int = flag(36, "pdmux: without divisions, split group = decode batch * (groups - 2) // this "
                                 "(SGLang's decode_bs_divisor).")
    pdmux_token_budget: int = flag(65536, "pdmux: a prefill batch of N tokens advances max(1, this // N) layers a "
                                   "step (SGLang's split_forward_token_budget).")

    def __post_init__(self) -> None:
        if self.policy not in POLICY_CHOICES:
            raise ConfigError(f"--policy (--planner) must be one of {', '.join(POLICY_CHOICES)}, got {self.policy!r}")
        at_least(self, 1, "max_num_seqs", "max_num_batched_tokens", "max_waiting", "chunk_budget",
                  "layers_per_step", "layerwise_decode_sms", "pdmux_bs_divisor", "pdmux_token_budget")
        at_least(self, 3, "pdmux_sm_groups")
        if len(self.pdmux_division_list) not in (0, self.pdmux_sm_groups - 2):
            raise ConfigError(f"--pdmux-divisions gives {len(self.pdmux_division_list)} divisions; --pdmux-sm-groups "
                              f"{self.pdmux_sm_groups} takes {self.pdmux_sm_groups - 2} (all-prefill and all-decode "
                              "are the other two groups)")

    @property
    def pdmux_division_list(self) -> tuple[tuple[int, int, int], ...]:
        """--pdmux-divisions as (prefill SMs, decode SMs, smallest decode batch) triples."""
        text = self.pdmux_divisions or ""
        out = tuple(tuple(int(x) for x in d.split(":") if x.strip().isdigit()) for d in text.split(",") if text)
        if any(len(d) != 3 or min(d) < 1 for d in out):
            raise ConfigError(f"--pdmux-divisions: cannot read {self.pdmux_divisions!r}; write PREFILL_SMS:DECODE_SMS:"
                              "MIN_BATCH triples, comma-separated, e.g. 112:20:1,104:28:5")
        return out  # type: ignore[return-value]

    @functools.cached_property
    def contract(self) -> Contract:
        """The SLO contract, parsed once (every problem with its line)."""
        return load_contract(self.slo) if self.slo else default_contract()

    @functools.cached_property
    def profile_file(self) -> ProfileFile | str | None:
        """The latency profile, parsed once; the reason as text when it cannot be read (the engine then plans with
        the roofline prior and says why); None without --profile."""
        if self.profile is None:
            return None
        try:
            return read_profile(self.profile)
        except ConfigError as exc:
            return str(exc)

    @property
    def tuned_chunk_budget(self) -> int | None:
        """The chunked policy's budget: --chunk-budget; unset, None where a profile lets the engine tune it to the
        contract's TBT target, else --max-num-batched-tokens (vLLM: the tokens of one step)."""
        if self.chunk_budget is not None:
            return self.chunk_budget
        return None if self.profile is not None else self.max_num_batched_tokens


_VLLM_ATTENTION = {"FLASHINFER": "flashinfer", "TORCH_SDPA": "torch"}  # vLLM's backend names -> muxd's
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")  # vLLM's
GRAPH_KEYS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size", "cudagraph_mode")


def _compilation_config(text: str, given: int | None) -> dict[str, Any]:
    """vLLM's --compilation-config as muxd takes it: a level (a number), or JSON of a level ('level' or 'mode') and
    the CUDA-graph keys GRAPH_KEYS; returns {"level": int | None, **the graph keys given}."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise ConfigError(f"--compilation-config: cannot read {text!r} as a level or JSON") from None
    graphs: dict[str, Any] = {}
    if isinstance(value, dict):
        other = sorted(set(value) - {"level", "mode", *GRAPH_KEYS})
        if other:
            raise ConfigError(f"--compilation-config: muxd decides its own fusions and takes only a level (as -O) "
                              f"and the CUDA-graph keys {', '.join(GRAPH_KEYS)}; leave out "
                              f"{', '.join(map(repr, other))}")
        graphs = {k: value[k] for k in GRAPH_KEYS if k in value}
        levels = {value[k] for k in ("level", "mode") if k in value}
        if not levels:
            return {"level": None, **graphs}
        value = levels.pop() if len(levels) == 1 else None
    if type(value) is not int or (given is not None and given != value):
        raise ConfigError(f"--compilation-config {text}: expected one level 0-3 (that -O does not contradict)")
    return {"level": value, **graphs}


def _capture_sizes(value: Any, where: str) -> tuple[int, ...]:
    """CUDA-graph batch sizes as a sorted tuple of distinct positive integers."""
    if not isinstance(value, (list, tuple)) or not value or not all(type(v) is int and v >= 1 for v in value):
        raise ConfigError(f"{where}: expected a list of batch sizes >= 1, got {value!r}")
    return tuple(sorted(set(value)))


@dataclass(frozen=True)
class RuntimeSettings:
    device: str = flag("auto", "auto, cpu, cuda or cuda:N.")
    attention_backend: str = flag("auto", "auto (flashinfer on CUDA where it supports the model, else torch), "
                                  "flashinfer or torch.")
    decode_kernel: str = flag("auto", "Attention kernel of CUDA-graph decode steps: auto (muxd's Triton kernels "
                              "where they take the model's shape: split-KV up to 8 rows, beyond them rows cut into "
                              "work items of equal pages; else flashinfer's), flashinfer, or triton (muxd's, and "
                              "an error where the shape does not suit them).")
    decode_blas: str = flag("cublaslt", "BLAS library of the CUDA-graph decode steps' GEMMs: cublaslt (measured "
                            "0.5-3 % faster at decode's rows) or cublas (torch's default, which prefill keeps).")
    fused_rope: bool = flag(True, "With the flashinfer backend, one kernel rotates q and k (after Qwen3's q/k "
                            "norms) and writes K/V (off: the compiled layer does, as before).")
    pdl: bool = flag(True, "On Hopper and later GPUs, launch the kernels of one-row steps (the single-token "
                     "compiled graph's and muxd's Triton kernels) with programmatic dependent launch: each launch "
                     "overlaps the end of the kernel before it; off: plain launches.")
    compile: Optional[bool] = flag(None, "torch.compile each decoder layer (default: on with CUDA, off on CPU).")
    cuda_graph: bool = flag(True, "Replay decode steps as CUDA graphs (CUDA with the flashinfer backend); off for "
                            "debugging.")
    max_graph_batch: Optional[int] = flag(None, "Largest decode batch captured as a CUDA graph (default: "
                                          "min(--max-num-seqs, 256), or the largest --cudagraph-capture-sizes).",
                                          "--max-cudagraph-capture-size")
    cudagraph_capture_sizes: Optional[list[int]] = flag(None, "Decode batch sizes captured as CUDA graphs, as vLLM's "
                                                        "(`--cudagraph-capture-sizes 1 2 4 8`): a batch replays the "
                                                        "smallest that holds it, a larger one runs eagerly. Default: "
                                                        "1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, up "
                                                        "to --max-graph-batch.")
    cuda_graph_sizes: Optional[list[int]] = flag(None, "vLLM 0.9-0.10's spelling: one value is "
                                                 "--max-cudagraph-capture-size, several are "
                                                 "--cudagraph-capture-sizes.", hidden=True)
    prefill_graph_rows: Optional[int] = flag(None, "Prefill launches and mixed steps of up to this many tokens "
                                             "replay piecewise CUDA graphs (attention eager between them, as in "
                                             "vLLM); 0: off. Default: 2048 for a layer the size of Llama-3.1-8B's "
                                             "or larger, more for smaller layers (Qwen2.5-0.5B: 8192), whose eager "
                                             "launches the GPU would wait for; for --policy chunked at most its "
                                             "step's budget, so that every mixed step replays them.")
    multiplex: Optional[bool] = flag(None, "Run prefill and decode at once on disjoint SM partitions (default: on "
                                     "with CUDA for the mux and layerwise policies).")
    async_scheduling: bool = flag(True, "Overlap the engine's host work with the device: plan and launch each step "
                                  "while the previous one runs and read its tokens afterwards (as vLLM's async "
                                  "scheduling); a row whose next sample needs its latest token (a grammar, a penalty) "
                                  "is sampled once that token is read, while its forward runs. Off: every step's "
                                  "tokens are read before the next is planned.")
    partition_granularity: int = flag(16, "Decode partitions are multiples of this many SMs (a multiple of 8 on "
                                      "Hopper).")
    enforce_eager: bool = flag(False, "As vLLM's: every step eager, no CUDA graphs and no torch.compile (the same as "
                               "--no-cuda-graph --no-compile).")
    optimization_level: Optional[int] = flag(None, "As vLLM's -O: 0 is --enforce-eager; 1, 2 and 3 leave muxd's "
                                             "compilation and CUDA graphs as they are.", "-O", hidden=True)
    compilation_config: Optional[str] = flag(None, "As vLLM's: a level (as -O), or JSON of 'level' (or 'mode') "
                                             "and the CUDA-graph keys 'cudagraph_capture_sizes', "
                                             "'max_cudagraph_capture_size' (as the flags of those names) and "
                                             "'cudagraph_mode' (NONE: no CUDA graphs; FULL_DECODE_ONLY: no prefill "
                                             "graphs; PIECEWISE, FULL and FULL_AND_PIECEWISE: muxd's whole-step "
                                             "decode graphs and piecewise prefill graphs). muxd decides its own "
                                             "fusions.", hidden=True)

    def __post_init__(self) -> None:
        if self.cuda_graph_sizes:  # (none given on the command line: an empty list)
            self._apply_cuda_graph_sizes(self.cuda_graph_sizes)
        if self.cudagraph_capture_sizes is not None:  # (none given on the command line: an empty list)
            object.__setattr__(self, "cudagraph_capture_sizes", _capture_sizes(
                self.cudagraph_capture_sizes, "--cudagraph-capture-sizes") if self.cudagraph_capture_sizes else None)
        if self.compilation_config is not None:
            self._apply_compilation_config(_compilation_config(self.compilation_config, self.optimization_level))
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and self.max_graph_batch is not None and self.max_graph_batch != sizes[-1]:
            raise ConfigError(f"--max-cudagraph-capture-size (--max-graph-batch) {self.max_graph_batch} is not the "
                              f"largest of --cudagraph-capture-sizes {' '.join(map(str, sizes))}; give one or make "
                              "them agree")
        if self.optimization_level is not None and self.optimization_level not in (0, 1, 2, 3):
            raise ConfigError(f"-O (--optimization-level) must be 0, 1, 2 or 3, got {self.optimization_level}")
        if self.optimization_level == 0:
            object.__setattr__(self, "enforce_eager", True)
        if self.enforce_eager:
            if self.compile:
                raise ConfigError("--enforce-eager and --compile contradict each other; give one")
            object.__setattr__(self, "cuda_graph", False)  # frozen: the one place a field follows another
            object.__setattr__(self, "compile", False)
        if self.attention_backend in _VLLM_ATTENTION:  # vLLM's spelling of the backends muxd has
            object.__setattr__(self, "attention_backend", _VLLM_ATTENTION[self.attention_backend])
        if self.attention_backend not in BACKEND_NAMES:
            upper = self.attention_backend.isupper()
            vllm = " (of vLLM's backends muxd has FLASHINFER and TORCH_SDPA)" if upper else ""
            raise ConfigError(f"--attention-backend must be one of {', '.join(BACKEND_NAMES)}, "
                              f"got {self.attention_backend!r}{vllm}")
        if self.decode_kernel not in DECODE_KERNELS:
            raise ConfigError(f"--decode-kernel must be one of {', '.join(DECODE_KERNELS)}, "
                              f"got {self.decode_kernel!r}")
        if self.decode_blas not in DECODE_BLAS:
            raise ConfigError(f"--decode-blas must be one of {', '.join(DECODE_BLAS)}, got {self.decode_blas!r}")
        if self.prefill_graph_rows is not None and self.prefill_graph_rows < 0:
            raise ConfigError(f"--prefill-graph-rows must be >= 0 (0: no prefill graphs), got "
                              f"{self.prefill_graph_rows}")
        at_least(self, 1, "max_graph_batch")
        if self.partition_granularity < 8 or self.partition_granularity % 8:
            raise ConfigError(f"--partition-granularity must be a positive multiple of 8 SMs, got "
                              f"{self.partition_granularity}")

    def _apply_cuda_graph_sizes(self, given: list[int]) -> None:
        """vLLM 0.9-0.10's --cuda-graph-sizes: one value is the largest decode graph (--max-cudagraph-capture-size),
        several are the graphs (--cudagraph-capture-sizes); refused where those flags say otherwise."""
        sizes = _capture_sizes(given, "--cuda-graph-sizes")
        name, value, flag_name = (("max_graph_batch", sizes[0], "--max-cudagraph-capture-size") if len(given) == 1
                                  else ("cudagraph_capture_sizes", list(sizes), "--cudagraph-capture-sizes"))
        current = getattr(self, name)
        if current and (sorted(set(current)) if isinstance(current, list) else current) != value:
            shown = " ".join(map(str, current)) if isinstance(current, list) else current
            raise ConfigError(f"--cuda-graph-sizes {' '.join(map(str, given))} (vLLM 0.9-0.10's {flag_name}) "
                              f"contradicts {flag_name} {shown}; give one")
        object.__setattr__(self, name, value)

    def _apply_compilation_config(self, given: dict[str, Any]) -> None:
        """The fields --compilation-config sets (`_compilation_config`), refusing one that a flag sets otherwise."""
        def take(name: str, value: Any, flag: str) -> None:
            if getattr(self, name) is not None and getattr(self, name) != value:
                raise ConfigError(f"--compilation-config sets {flag} to {value}, the flag to {getattr(self, name)}; "
                                  "give one")
            object.__setattr__(self, name, value)

        if given["level"] is not None:
            take("optimization_level", given["level"], "-O")
        if "cudagraph_capture_sizes" in given:
            take("cudagraph_capture_sizes", _capture_sizes(given["cudagraph_capture_sizes"],
                                                           "--compilation-config cudagraph_capture_sizes"),
                 "--cudagraph-capture-sizes")
        if "max_cudagraph_capture_size" in given:
            largest = given["max_cudagraph_capture_size"]
            if type(largest) is not int or largest < 1:
                raise ConfigError(f"--compilation-config max_cudagraph_capture_size: expected a batch size >= 1, got "
                                  f"{largest!r}")
            take("max_graph_batch", largest, "--max-cudagraph-capture-size")
        mode = given.get("cudagraph_mode")
        if mode is not None:
            if not isinstance(mode, str) or mode.upper() not in CUDAGRAPH_MODES:
                raise ConfigError(f"--compilation-config cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, "
                                  f"got {mode!r}")
            if mode.upper() == "NONE":
                object.__setattr__(self, "cuda_graph", False)
            elif mode.upper() == "FULL_DECODE_ONLY":
                take("prefill_graph_rows", 0, "--prefill-graph-rows")

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device


@dataclass(frozen=True)
class ParallelSettings:
    tensor_parallel_size: int = flag(1, "GPUs the model is split across (tensor parallelism), one process each, "
                                     "started by muxd; every rank multiplexes prefill and decode on the same SM "
                                     "partitions. 1: one GPU, no process group.", "-tp")
    dist_timeout: float = flag(600.0, "Seconds a collective between ranks may wait before the engine gives up (a "
                               "rank that stopped answering); a rank that exits ends the server at once.")

    def __post_init__(self) -> None:
        at_least(self, 1, "tensor_parallel_size", "dist_timeout")


@dataclass(frozen=True)
class ServerSettings:
    host: str = flag("127.0.0.1", "Address to bind; use 0.0.0.0 to accept connections from other machines.",
                     envvar="MUXD_HOST")
    port: int = flag(8000, "TCP port.", envvar="MUXD_PORT")
    api_key: Optional[str] = flag(None, "Require 'Authorization: Bearer KEY' on every /v1 and /debug route (/health, "
                                  "/ready and /metrics stay open).", envvar="MUXD_API_KEY")
    max_request_bytes: str = flag("16MiB", "Largest request body (e.g. 16MiB or 1048576); larger ones get HTTP 413.")
    header_timeout: float = flag(10.0, "Seconds a connection may take to send a request's headers (from opening, or "
                                 "from its previous response); slower connections are closed.")
    body_timeout: float = flag(30.0, "Seconds a request's whole body may take to arrive after its headers; slower "
                               "requests get HTTP 408. A request takes its place among --max-num-seqs + "
                               "--max-waiting only once its body has arrived.")
    shutdown_timeout: float = flag(30.0, "On SIGTERM/SIGINT, seconds running requests may take to finish (new ones "
                                   "get 503) before they are ended.")
    engine_restarts: int = flag(3, "After an engine step fails (its requests end with an error), rebuild the engine "
                                "in process around the loaded weights, at most this many times within "
                                "--engine-restart-window; one failure more stops the server (exit 1) so that its "
                                "supervisor restarts it. 0: stop at the first failure.")
    engine_restart_window: float = flag(300.0, "Seconds over which --engine-restarts counts failed steps.")
    trace_dir: Optional[str] = flag(None, "Write the executor's timeline (Chrome-trace JSON) here when the server "
                                    "stops; GET /debug/timeline serves it live.")
    log_level: str = flag("info", "debug, info, warning, error.")
    tool_call_parser: str = flag("auto", "How tool calls are read from the output with tool_choice auto: hermes "
                                 "(<tool_call> blocks: Qwen 2.5/3), llama3_json (Llama 3.x), pythonic ([f(a=1), g()]: "
                                 "Llama 3.2 with a pythonic chat template), none, or auto (from the chat "
                                 "template).")
    reasoning_parser: str = flag("none", "Return what a thinking model writes between <think> and </think> as the "
                                 "chat message's `reasoning`, apart from its content (as vLLM's flag): qwen3 (Qwen3; "
                                 "enable_thinking false in chat_template_kwargs turns thinking off), deepseek_r1, or "
                                 "none.")
    enable_auto_tool_choice: bool = flag(True, "Let the model choose whether to call a tool (tool_choice auto); "
                                         "off: requests with tools and tool_choice auto get HTTP 400.")
    trust_request_chat_template: bool = flag(False, "As vLLM's: a chat request may bring its own chat_template "
                                             "(rendered in the same sandbox as the model's); without this flag such "
                                             "a request gets HTTP 400.")
    exclude_tools_when_tool_choice_none: bool = flag(False, "As vLLM's: a request with tool_choice none renders no "
                                                     "tools into the prompt (by default the chat template gets them, "
                                                     "as OpenAI's and vLLM's do; the output is never read as calls).")
    stream_interval: int = flag(1, "As vLLM's: tokens a stream gathers into one chunk. 1 sends each token as it "
                                "is read; N sends a choice's first token at once, then a chunk every N tokens, and "
                                "its last ones when it ends (fewer chunks for clients that need no token-by-token "
                                "display).")
    allowed_origins: str = flag('["*"]', "CORS: origins browsers may call from, a JSON list (as vLLM's flag).")
    allowed_methods: str = flag('["*"]', "CORS: methods allowed to other origins, a JSON list.")
    allowed_headers: str = flag('["*"]', "CORS: request headers allowed to other origins, a JSON list.")
    allow_credentials: bool = flag(False, "CORS: let other origins send credentials (cookies, Authorization).")
    ssl_keyfile: Optional[str] = flag(None, "Serve HTTPS: the private key (PEM file), with --ssl-certfile.")
    ssl_certfile: Optional[str] = flag(None, "Serve HTTPS: the certificate (PEM file), with --ssl-keyfile.")
    ssl_ca_certs: Optional[str] = flag(None, "HTTPS: the CA certificates (PEM file) that client certificates are "
                                       "checked against.")
    ssl_cert_reqs: int = flag(0, "HTTPS: client certificates 0: not asked for, 1: checked if sent, 2: required "
                              "(Python's ssl.CERT_NONE/OPTIONAL/REQUIRED).")
    ssl_ciphers: Optional[str] = flag(None, "HTTPS: the TLS 1.2 cipher suites offered, an OpenSSL cipher list (e.g. "
                                      "ECDHE+AESGCM); default: uvicorn's.")
    uds: Optional[str] = flag(None, "Listen on this Unix domain socket instead of --host and --port.")
    h11_max_incomplete_event_size: Optional[int] = flag(None, "Bytes of a request's line and headers buffered while "
                                                        "they are incomplete (h11's limit; beyond it, HTTP 400). "
                                                        "Default: h11's, 16 KiB (vLLM's: 4 MiB).", hidden=True)
    h11_max_header_count: int = flag(256, "Headers a request may carry; more get HTTP 431 (as vLLM's).", hidden=True)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be in 1..65535, got {self.port}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ConfigError("HTTPS needs both --ssl-keyfile and --ssl-certfile; give both, or neither")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path is not None and not Path(path).expanduser().is_file():
                raise ConfigError(f"--{name.replace('_', '-')} {path}: no such file")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ConfigError(f"--ssl-cert-reqs must be 0, 1 or 2, got {self.ssl_cert_reqs}")
        if (self.ssl_ca_certs is not None or self.ssl_cert_reqs or self.ssl_ciphers is not None) and \
                self.ssl_certfile is None:
            raise ConfigError("--ssl-ca-certs, --ssl-cert-reqs and --ssl-ciphers apply to HTTPS: give --ssl-keyfile "
                              "and --ssl-certfile too")
        if self.ssl_ciphers is not None:
            try:
                ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).set_ciphers(self.ssl_ciphers)
            except ssl.SSLError:
                raise ConfigError(f"--ssl-ciphers {self.ssl_ciphers}: OpenSSL knows no cipher of that list (e.g. "
                                  "ECDHE+AESGCM)") from None
        if self.request_byte_limit < 1:
            raise ConfigError(f"--max-request-bytes must be at least 1 byte, got {self.max_request_bytes!r}")
        if not (self.header_timeout > 0 and self.body_timeout > 0):
            raise ConfigError(f"--header-timeout and --body-timeout must be > 0 seconds, got {self.header_timeout} "
                              f"and {self.body_timeout}")
        if not self.shutdown_timeout >= 0:
            raise ConfigError(f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        for name in ("h11_max_incomplete_event_size", "h11_max_header_count", "stream_interval"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got "
                              f"{self.tool_call_parser!r}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, got "
                              f"{self.reasoning_parser!r}")
        if self.engine_restarts < 0 or not self.engine_restart_window > 0:
            raise ConfigError(f"--engine-restarts must be >= 0 and --engine-restart-window > 0 seconds, got "
                              f"{self.engine_restarts} and {self.engine_restart_window}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key (or MUXD_API_KEY) is empty; give a key or leave it unset")
        self.cors()

    def cors(self) -> dict[str, Any]:
        """Starlette's CORSMiddleware arguments from the --allowed-* flags (as `vllm serve` applies them)."""
        return {"allow_origins": json_list(self.allowed_origins, "--allowed-origins"),
                "allow_methods": json_list(self.allowed_methods, "--allowed-methods"),
                "allow_headers": json_list(self.allowed_headers, "--allowed-headers"),
                "allow_credentials": self.allow_credentials}

    @property
    def request_byte_limit(self) -> int:
        return parse_size(self.max_request_bytes, "--max-request-bytes")


@dataclass(frozen=True)
class VllmFlags:
    """`vllm serve` flags that muxd takes so that a vLLM command line starts it unchanged (hidden from --help): each
    either asks for nothing muxd would do differently, or holds only at the value muxd works with, and anything else
    is a ConfigError naming it."""

    trust_remote_code: bool = flag(False, "Accepted: muxd runs no code from model directories.", hidden=True)
    disable_log_requests: bool = flag(False, "Accepted: requests are logged only with --enable-log-requests.", hidden=True)
    disable_log_stats: bool = flag(False, "Accepted: muxd logs no statistics (they are at /metrics).", hidden=True)
    enable_chunked_prefill: Optional[bool] = flag(None, "Accepted: --policy decides how prompts are cut (chunked "
                                                  "is vLLM's way).", hidden=True)
    swap_space: Optional[float] = flag(None, "Accepted: muxd preempts by recomputation, not by swapping to the "
                                       "CPU.", hidden=True)
    kv_cache_dtype: str = flag("auto", "Only auto: the KV cache keeps the model's dtype (--dtype).", hidden=True)
    quantization: Optional[str] = flag(None, "Only unset: muxd serves unquantized checkpoints.", "-q", hidden=True)
    tokenizer: Optional[str] = flag(None, "Only the model directory: muxd reads the tokenizer there.", hidden=True)
    uvicorn_log_level: Optional[str] = flag(None, "The HTTP server's log level (default: --log-level).",
                                            hidden=True)
    pipeline_parallel_size: int = flag(1, "Only 1: muxd splits a model across GPUs by --tensor-parallel-size.",
                                       "-pp", hidden=True)
    data_parallel_size: int = flag(1, "Only 1: replicas are `muxd serve --replicas N` (or `muxd cluster`).", "-dp",
                                   hidden=True)
    disable_uvicorn_access_log: bool = flag(False, "Turn off the HTTP server's access log.", hidden=True)
    disable_fastapi_docs: bool = flag(False, "Serve no /docs, /redoc and /openapi.json.", hidden=True)
    disable_access_log_for_endpoints: Optional[str] = flag(None, "Paths whose requests the access log leaves out, "
                                                           "comma-separated (e.g. /health,/metrics).", hidden=True)
    disable_uvicorn_metrics_access_log: bool = flag(False, "Leave /health and /metrics out of the access log.",
                                                    hidden=True)
    root_path: Optional[str] = flag(None, "The path prefix a proxy serves muxd under (FastAPI's root_path): routes "
                                    "answer with and without it.", hidden=True)
    max_log_len: Optional[int] = flag(None, "With --enable-log-requests: the characters of a prompt and output, and "
                                      "the token ids, each log line holds (default: all).", hidden=True)
    enable_log_requests: bool = flag(False, "As vLLM's: log each request as it arrives, its prompt (text and token "
                                     "ids) and sampling parameters.", hidden=True)
    tokenizer_mode: str = flag("auto", "Only auto or hf: muxd runs the fast tokenizer of tokenizer.json.",
                               hidden=True)
    enable_request_id_headers: bool = flag(False, "Every response carries an X-Request-Id header: the request's "
                                           "own, else a new one.", hidden=True)
    return_tokens_as_token_ids: bool = flag(False, "Log-probabilities name tokens 'token_id:<id>' unless a request "
                                            "says otherwise (its return_tokens_as_token_ids).", hidden=True)
    response_role: str = flag("assistant", "Only assistant: the role of chat answers.", hidden=True)
    chat_template_content_format: str = flag("auto", "Only auto or string: message content reaches the chat "
                                             "template as one string (text parts joined).", hidden=True)
    max_logprobs: int = flag(20, "Only 20: muxd returns at most 20 alternatives per token.", hidden=True)
    enable_force_include_usage: bool = flag(False, "Every stream ends with a usage chunk, as if each request asked "
                                            "for it (stream_options.include_usage).", hidden=True)
    enable_prompt_tokens_details: bool = flag(False, "Accepted: usage always carries prompt_tokens_details "
                                              "(cached_tokens).", hidden=True)
    disable_frontend_multiprocessing: bool = flag(False, "Accepted: muxd's HTTP server and engine share one "
                                                  "process.", hidden=True)
    disable_custom_all_reduce: bool = flag(False, "Accepted: tensor parallelism reduces with NCCL.", hidden=True)
    max_seq_len_to_capture: Optional[int] = flag(None, "Accepted: muxd's decode graphs serve every context length.",
                                                 hidden=True)
    distributed_executor_backend: Optional[str] = flag(None, "Only mp: muxd starts one process per GPU itself.",
                                                       hidden=True)
    cpu_offload_gb: float = flag(0.0, "Only 0: muxd keeps the weights on the GPU.", hidden=True)
    scheduling_policy: str = flag("fcfs", "Only fcfs: requests are admitted in arrival order.", hidden=True)
    preemption_mode: Optional[str] = flag(None, "Only recompute: muxd preempts by recomputation.", hidden=True)
    long_prefill_token_threshold: int = flag(0, "Only 0: --policy decides how prompts are cut.", hidden=True)
    max_num_partial_prefills: int = flag(1, "Only 1: --policy decides how prompts are cut.", hidden=True)
    max_long_partial_prefills: int = flag(1, "Only 1: --policy decides how prompts are cut.", hidden=True)
    disable_cascade_attn: bool = flag(False, "Accepted: muxd has no cascade attention.", hidden=True)
    max_parallel_loading_workers: Optional[int] = flag(None, "Accepted: muxd reads the weights in one pass.",
                                                       hidden=True)
    model_impl: str = flag("auto", "Only auto or vllm: muxd runs its own model code.", hidden=True)
    api_server_count: int = flag(1, "Only 1: one HTTP server per engine.", hidden=True)
    show_hidden_metrics_for_version: Optional[str] = flag(None, "Accepted: /metrics shows every series.",
                                                          hidden=True)
    guided_decoding_backend: Optional[str] = flag(None, "Only auto or xgrammar: structured output runs on xgrammar.",
                                                  hidden=True)
    structured_outputs_config: Optional[str] = flag(None, "Only JSON whose backend is auto or xgrammar.", hidden=True)
    enable_sleep_mode: bool = flag(False, "Only off: muxd has no sleep mode.", hidden=True)
    enable_lora: bool = flag(False, "Only off: muxd serves no LoRA adapters.", hidden=True)
    speculative_config: Optional[str] = flag(None, "Only unset: muxd has no speculative decoding.", hidden=True)
    enable_log_outputs: bool = flag(False, "As vLLM's, with --enable-log-requests: log each choice's output when it "
                                    "ends.", hidden=True)
    enable_prompt_embeds: bool = flag(False, "Only off: prompts are text or token ids.", hidden=True)
    skip_tokenizer_init: bool = flag(False, "Only off: muxd tokenizes and detokenizes itself.", hidden=True)
    enable_tokenizer_info_endpoint: bool = flag(False, "GET /tokenizer_info answers the tokenizer's configuration "
                                                "(tokenizer_config.json's fields, its class, the chat template "
                                                "served), as vLLM's.", hidden=True)
    enable_server_load_tracking: bool = flag(False, "/load counts the requests in flight (without it /load answers "
                                             "0), as vLLM's.", hidden=True)
    lora_modules: Optional[list[str]] = flag(None, "Only unset: muxd serves no LoRA adapters.", hidden=True)
    limit_mm_per_prompt: Optional[str] = flag(None, "Only unset: muxd serves text-only models.", hidden=True)
    otlp_traces_endpoint: Optional[str] = flag(None, "Only unset: muxd exports no OpenTelemetry traces.",
                                               hidden=True)
    task: str = flag("auto", "Only auto or generate (vLLM's older --runner): muxd generates text.", hidden=True)
    runner: str = flag("auto", "Only auto or generate: muxd generates text.", hidden=True)
    convert: str = flag("auto", "Only auto or none: muxd generates text.", hidden=True)
    enable_reasoning: bool = flag(False, "Accepted (vLLM 0.8's companion of --reasoning-parser): "
                                  "--reasoning-parser alone decides.", hidden=True)
    disable_sliding_window: bool = flag(False, "As vLLM's: the context defaults to the model's sliding window where "
                                        "that is shorter (muxd has no sliding-window attention and refuses a "
                                        "longer context).", hidden=True)
    num_scheduler_steps: int = flag(1, "Accepted: each step is planned while the one before runs "
                                    "(--async-scheduling) instead of several steps at once.", hidden=True)
    multi_step_stream_outputs: bool = flag(True, "Accepted: tokens stream as each step reads them.", hidden=True)
    use_v2_block_manager: bool = flag(False, "Accepted: muxd's KV pages are its own.", hidden=True)
    scheduler_delay_factor: float = flag(0.0, "Only 0: --policy decides when prompts run.", hidden=True)
    tokenizer_revision: Optional[str] = flag(None, "Only unset: muxd downloads nothing.", hidden=True)
    code_revision: Optional[str] = flag(None, "Only unset: muxd runs no code from model directories.", hidden=True)
    hf_token: Optional[str] = flag(None, "Accepted: muxd downloads nothing (a model id is read from the local "
                                   "Hugging Face cache).", hidden=True)
    hf_config_path: Optional[str] = flag(None, "Only unset: muxd reads config.json from the model directory.",
                                         hidden=True)
    scheduler_cls: Optional[str] = flag(None, "Only unset or vLLM's own scheduler: --policy plans each step.",
                                        hidden=True)
    config_format: str = flag("auto", "Only auto or hf: muxd reads config.json.", hidden=True)
    enable_expert_parallel: bool = flag(False, "Only off: muxd serves dense models.", hidden=True)
    max_loras: Optional[int] = flag(None, "Accepted: muxd serves no LoRA adapters (see --enable-lora).", hidden=True)
    max_lora_rank: Optional[int] = flag(None, "Accepted: muxd serves no LoRA adapters.", hidden=True)
    max_cpu_loras: Optional[int] = flag(None, "Accepted: muxd serves no LoRA adapters.", hidden=True)
    lora_dtype: Optional[str] = flag(None, "Accepted: muxd serves no LoRA adapters.", hidden=True)
    log_error_stack: bool = flag(False, "Accepted: an unexpected error's traceback is always logged.", hidden=True)
    prefix_caching_hash_algo: str = flag("sha256", "Accepted (any of vLLM's): muxd keys cached pages by a BLAKE2b "
                                         "chain of their tokens.", hidden=True)
    middleware: Optional[list[str]] = flag(None, "Only unset: muxd loads no code named on its command line.",
                                           hidden=True)
    logits_processors: Optional[list[str]] = flag(None, "Only unset: muxd runs no custom logits processors.",
                                                  hidden=True)
    kv_transfer_config: Optional[str] = flag(None, "Only unset: no KV transfer between instances.", hidden=True)
    kv_events_config: Optional[str] = flag(None, "Only unset: muxd publishes no KV cache events.", hidden=True)
    tool_parser_plugin: Optional[str] = flag(None, "Only unset: --tool-call-parser takes muxd's own parsers.",
                                             hidden=True)
    headless: bool = flag(False, "Only off: muxd serves its API from the process that runs the engine.", hidden=True)
    allowed_local_media_path: Optional[str] = flag(None, "Accepted: muxd serves text-only models, and a request "
                                                   "with media is refused whatever this says.", hidden=True)
    allowed_media_domains: Optional[list[str]] = flag(None, "Accepted: as --allowed-local-media-path.", hidden=True)
    calculate_kv_scales: bool = flag(False, "Accepted: the KV cache keeps the model's dtype (no fp8 scales to "
                                     "calculate).", hidden=True)
    use_tqdm_on_load: bool = flag(True, "Accepted: muxd reads the weights without a progress bar.", hidden=True)
    mm_processor_cache_gb: Optional[float] = flag(None, "Accepted: muxd serves text-only models.", hidden=True)
    skip_mm_profiling: bool = flag(False, "Accepted: muxd serves text-only models.", hidden=True)
    mm_encoder_tp_mode: Optional[str] = flag(None, "Accepted: muxd serves text-only models.", hidden=True)
    disable_hybrid_kv_cache_manager: bool = flag(False, "Accepted: muxd's KV cache is one pool of pages for every "
                                                 "layer.", hidden=True)
    safetensors_load_strategy: Optional[str] = flag(None, "Accepted: muxd reads the safetensors its own way.",
                                                    hidden=True)
    pt_load_map_location: Optional[str] = flag(None, "Accepted: muxd reads safetensors, never .pt files.",
                                               hidden=True)
    kv_sharing_fast_prefill: bool = flag(False, "Only off: muxd's models share no KV cache across layers.",
                                         hidden=True)
    enable_eplb: bool = flag(False, "Only off: muxd serves dense models.", hidden=True)
    enable_elastic_ep: bool = flag(False, "Only off: muxd serves dense models.", hidden=True)
    enable_dbo: bool = flag(False, "Only off: muxd has no dual-batch overlap.", hidden=True)
    data_parallel_size_local: Optional[int] = flag(None, "Only unset or 1: replicas are --replicas N.", hidden=True)
    pooler_config: Optional[str] = flag(None, "Only unset: muxd serves text generation.", hidden=True)
    tool_server: Optional[str] = flag(None, "Only unset: muxd runs no built-in tools.", hidden=True)
    ignore_patterns: Optional[list[str]] = flag(None, "Accepted: muxd downloads nothing and reads the model "
                                                "directory's top-level safetensors.", hidden=True)
    model_loader_extra_config: Optional[str] = flag(None, "Only unset or {}: muxd's loader takes no options.",
                                                    hidden=True)
    tokenizer_pool_size: int = flag(0, "Only 0: muxd tokenizes in its own process.", hidden=True)
    logits_processor_pattern: Optional[str] = flag(None, "Accepted: requests name no logits processors in muxd "
                                                   "(there are none to allow).", hidden=True)
    collect_detailed_traces: Optional[list[str]] = flag(None, "Only unset: muxd exports no OpenTelemetry traces.",
                                                        hidden=True)
    disable_chunked_mm_input: bool = flag(False, "Accepted: muxd serves text-only models.", hidden=True)
    guided_decoding_disable_fallback: bool = flag(False, "Accepted: structured outputs run on xgrammar alone (a "
                                                  "grammar it cannot compile is a 400).", hidden=True)
    aggregate_engine_logging: bool = flag(False, "Accepted: muxd runs one engine a server.", hidden=True)
    num_lookahead_slots: int = flag(0, "Only 0: muxd has no speculative decoding.", hidden=True)
    enable_ssl_refresh: bool = flag(False, "Only off: muxd loads the TLS certificate at start.", hidden=True)
    kv_offloading_size: Optional[float] = flag(None, "Only unset: muxd keeps the KV cache on the GPU.", hidden=True)
    reasoning_parser_plugin: Optional[str] = flag(None, "Only unset: muxd loads no reasoning parser plugins.",
                                                  hidden=True)
    enable_mfu_metrics: bool = flag(False, "Only off: muxd exports no MFU metrics.", hidden=True)
    kv_cache_metrics: bool = flag(False, "Only off: muxd exports no KV cache residency metrics.", hidden=True)
    cudagraph_metrics: bool = flag(False, "Only off: muxd exports no CUDA graph metrics.", hidden=True)
    enable_layerwise_nvtx_tracing: bool = flag(False, "Only off: muxd adds no NVTX ranges.", hidden=True)
    enable_return_routed_experts: bool = flag(False, "Only off: muxd serves dense models.", hidden=True)
    data_parallel_hybrid_lb: bool = flag(False, "Only off: replicas are --replicas N.", hidden=True)
    override_pooler_config: Optional[str] = flag(None, "Only unset: muxd serves text generation.", hidden=True)
    attention_config: Optional[str] = flag(None, "Only unset or {}: --attention-backend and --decode-kernel choose "
                                           "muxd's attention.", hidden=True)
    ec_transfer_config: Optional[str] = flag(None, "Only unset: muxd has no encoder cache transfer.", hidden=True)
    log_config_file: Optional[str] = flag(None, "A logging configuration (JSON, Python's logging.config.dictConfig "
                                          "schema) for muxd's and the HTTP server's loggers, as vLLM's.",
                                          hidden=True)

    def __post_init__(self) -> None:
        for name in ("lora_modules", "middleware", "logits_processors", "allowed_media_domains", "ignore_patterns",
                     "collect_detailed_traces"):
            if not getattr(self, name):  # (none given on the command line: an empty list or tuple)
                object.__setattr__(self, name, None)
        if self.prefix_caching_hash_algo not in PREFIX_HASH_ALGOS:
            raise ConfigError(f"--prefix-caching-hash-algo must be one of {', '.join(PREFIX_HASH_ALGOS)}, got "
                              f"{self.prefix_caching_hash_algo!r}")
        for name, (allowed, why) in _VLLM_ONLY.items():  # the first field at a value muxd cannot honour
            value = getattr(self, name)
            if value not in allowed:
                shown = ("" if isinstance(value, bool) else f" {value:.15g}" if isinstance(value, float)
                         else f" {' '.join(map(str, value))}" if isinstance(value, list) else f" {value}")
                raise ConfigError(f"--{name.replace('_', '-')}{shown}: {why}")
        if self.structured_outputs_config is not None:
            _structured_outputs_backend(self.structured_outputs_config)
        if self.num_scheduler_steps < 1:
            raise ConfigError(f"--num-scheduler-steps must be >= 1, got {self.num_scheduler_steps}")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ConfigError(f"--max-log-len must be >= 0, got {self.max_log_len}")
        levels = ("critical", "error", "warning", "info", "debug", "trace")
        if self.uvicorn_log_level is not None and self.uvicorn_log_level not in levels:
            raise ConfigError(f"--uvicorn-log-level must be one of {', '.join(levels)}, got "
                              f"{self.uvicorn_log_level!r}")
        if self.log_config_file is not None:
            self.log_config()
        self.quiet_paths()
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ConfigError(f"--root-path must start with / and not end with one (e.g. /llm), got "
                              f"{self.root_path!r}")

    def quiet_paths(self) -> frozenset[str]:
        """The paths the access log leaves out (--disable-access-log-for-endpoints, and /health and /metrics with
        --disable-uvicorn-metrics-access-log)."""
        given = [p.strip() for p in (self.disable_access_log_for_endpoints or "").split(",") if p.strip()]
        bad = [p for p in given if not p.startswith("/")]
        if bad:
            raise ConfigError(f"--disable-access-log-for-endpoints takes paths starting with / (e.g. "
                              f"/health,/metrics), got {', '.join(map(repr, bad))}")
        return frozenset(given + (["/health", "/metrics"] if self.disable_uvicorn_metrics_access_log else []))

    def log_config(self) -> dict[str, Any] | None:
        """--log-config-file's logging configuration (None without one): a JSON object of dictConfig's schema."""
        if self.log_config_file is None:
            return None
        path = Path(self.log_config_file).expanduser()
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"--log-config-file {self.log_config_file}: cannot be read ({exc.strerror})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--log-config-file {self.log_config_file}: not valid JSON ({exc})") from None
        if not isinstance(config, dict) or config.get("version") != 1:
            raise ConfigError(f"--log-config-file {self.log_config_file}: expected a JSON object of Python's "
                              "logging.config.dictConfig schema, with \"version\": 1")
        return config


# vLLM flags muxd takes only at the values that ask for nothing it does differently: field -> (those values, why)
_VLLM_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "kv_cache_dtype": (("auto",), "muxd keeps the KV cache in the model's dtype (--dtype); only auto is accepted"),
    "quantization": ((None,), "muxd serves unquantized checkpoints (bfloat16, float16, float32); leave it out"),
    "pipeline_parallel_size": ((1,), "muxd has no pipeline parallelism; split the model across the GPUs of a host "
                                     "with --tensor-parallel-size"),
    "data_parallel_size": ((1,), "muxd serves replicas with --replicas N (one engine per GPU, on Ray Serve), not "
                                 "data parallelism"),
    "response_role": (("assistant",), "muxd's chat answers have the role assistant; leave it out"),
    "chat_template_content_format": (("auto", "string"), "muxd hands message content to the chat template as one "
                                                         "string (text parts joined), which is vLLM's string format; "
                                                         "give auto or string, or leave it out"),
    "distributed_executor_backend": ((None, "mp"), "muxd starts one process per GPU of this host itself (vLLM's mp); "
                                                   "give mp or leave it out"),
    "cpu_offload_gb": ((0,), "muxd keeps the weights on the GPU; leave it out (or split the model across GPUs with "
                             "--tensor-parallel-size)"),
    "max_logprobs": ((20,), "muxd returns at most 20 alternatives per token (vLLM's default); leave it out"),
    "tokenizer_mode": (TOKENIZER_MODES, "muxd runs the model directory's fast tokenizer (tokenizer.json), which is "
                                        "vLLM's auto (and hf); it has no slow, mistral or custom tokenizer; give auto "
                                        "or leave it out"),
    "scheduling_policy": (("fcfs",), "muxd admits requests in arrival order (--policy plans each step); it has no "
                                     "priority scheduling; give fcfs or leave it out"),
    "preemption_mode": ((None, "recompute"), "muxd preempts by recomputing a request's KV, it never swaps; give "
                                             "recompute or leave it out"),
    "long_prefill_token_threshold": ((0,), "--policy decides how prompts are cut and run beside decode (chunked is "
                                           "vLLM's way); leave it out"),
    "max_num_partial_prefills": ((1,), "--policy decides how prompts are cut and run beside decode (chunked is "
                                       "vLLM's way); leave it out"),
    "max_long_partial_prefills": ((1,), "--policy decides how prompts are cut and run beside decode (chunked is "
                                        "vLLM's way); leave it out"),
    "model_impl": (("auto", "vllm"), "muxd runs its own model code (Llama, Qwen2.5, Qwen3), not transformers'; give "
                                     "auto or leave it out"),
    "api_server_count": ((1,), "muxd runs one HTTP server per engine; serve more with --replicas N"),
    "guided_decoding_backend": ((None, "auto", "xgrammar"), "muxd's structured output runs on xgrammar; give "
                                                            "xgrammar or leave it out"),
    "enable_sleep_mode": ((False,), "muxd has no sleep mode; leave it out"),
    "enable_lora": ((False,), "muxd serves one model without LoRA adapters (merge an adapter into the weights and "
                              "serve that directory)"),
    "speculative_config": ((None,), "muxd has no speculative decoding; leave it out"),
    "enable_prompt_embeds": ((False,), "muxd takes prompts as text or token ids, not embeddings; leave it out"),
    "skip_tokenizer_init": ((False,), "muxd tokenizes prompts and detokenizes outputs itself; leave it out"),
    "lora_modules": ((None,), "muxd serves one model without LoRA adapters (merge an adapter into the weights and "
                              "serve that directory)"),
    "limit_mm_per_prompt": ((None,), "muxd serves text-only models (Llama, Qwen2.5, Qwen3); leave it out"),
    "otlp_traces_endpoint": ((None,), "muxd exports no OpenTelemetry traces (requests and steps are at /metrics and "
                                      "/debug/timeline); leave it out"),
    "task": (("auto", "generate"), "muxd serves text generation (no embedding, scoring or other pooling tasks); give "
                                   "generate or leave it out"),
    "runner": (("auto", "generate"), "muxd serves text generation (no pooling runner); give generate or leave it out"),
    "convert": (("auto", "none"), "muxd serves text generation and converts no model to another task; leave it out"),
    "scheduler_delay_factor": ((0, 0.0), "--policy decides when prompts run beside decode; leave it out"),
    "tokenizer_revision": ((None,), "muxd reads the tokenizer from the model directory and downloads nothing; leave "
                                    "it out"),
    "code_revision": ((None,), "muxd runs no code from model directories and downloads nothing; leave it out"),
    "hf_config_path": ((None,), "muxd reads config.json from the model directory (--hf-overrides replaces its "
                                "fields); leave it out"),
    "scheduler_cls": ((None, "vllm.core.scheduler.Scheduler", "vllm.v1.core.sched.scheduler.Scheduler",
                       "vllm.v1.core.sched.async_scheduler.AsyncScheduler"),
                      "muxd loads no scheduler class named on its command line; --policy chooses how each step is "
                      "planned (chunked is vLLM's way)"),
    "kv_sharing_fast_prefill": ((False,), "muxd's models (Llama, Qwen2.5, Qwen3) share no KV cache across layers; "
                                          "leave it out"),
    "enable_eplb": ((False,), "muxd serves dense models (Llama, Qwen2.5, Qwen3), without experts to balance; leave it "
                              "out"),
    "enable_elastic_ep": ((False,), "muxd serves dense models (Llama, Qwen2.5, Qwen3), without expert parallelism; "
                                    "leave it out"),
    "enable_dbo": ((False,), "muxd has no dual-batch overlap (its engine overlaps prefill and decode on SM partitions "
                             "instead); leave it out"),
    "data_parallel_size_local": ((None, 1), "muxd serves replicas with --replicas N (one engine per GPU, on Ray "
                                            "Serve), not data parallelism"),
    "pooler_config": ((None,), "muxd serves text generation (no embedding, scoring or other pooling); leave it out"),
    "tool_server": ((None,), "muxd runs no built-in tools (the tools of a request are called by its client); leave "
                             "it out"),
    "config_format": (("auto", "hf"), "muxd reads the model's config.json (Hugging Face's format); give hf or leave it "
                                      "out"),
    "enable_expert_parallel": ((False,), "muxd serves dense models (Llama, Qwen2.5, Qwen3), without experts; leave "
                                         "it out"),
    "middleware": ((None,), "muxd loads no code named on its command line (ASGI middleware); put a proxy in front "
                            "of it instead"),
    "logits_processors": ((None,), "muxd runs no custom logits processors; requests may use logit_bias, "
                                   "allowed_token_ids, bad_words, min_tokens and structured output"),
    "kv_transfer_config": ((None,), "muxd has no KV transfer between instances (disaggregated prefill); it runs "
                                    "prefill and decode on one GPU's SM partitions instead"),
    "kv_events_config": ((None,), "muxd publishes no KV cache events; leave it out"),
    "tool_parser_plugin": ((None,), "muxd loads no tool parser plugins; --tool-call-parser takes its built-in "
                                    "parsers"),
    "headless": ((False,), "muxd has no multi-node data parallelism (each replica serves its own API; --replicas N "
                           "spreads them over a Ray cluster); leave it out"),
    "model_loader_extra_config": ((None, "{}", ""), "muxd's loader takes no options (it reads the model directory's "
                                                    "safetensors as they are); leave it out"),
    "tokenizer_pool_size": ((0,), "muxd tokenizes in its own process (vLLM's tokenizer pools are gone from it too); "
                                  "leave it out"),
    "collect_detailed_traces": ((None,), "muxd exports no OpenTelemetry traces (requests and steps are at /metrics "
                                         "and /debug/timeline); leave it out"),
    "num_lookahead_slots": ((0,), "muxd has no speculative decoding (no lookahead slots to keep); leave it out"),
    "enable_ssl_refresh": ((False,), "muxd loads the TLS certificate and key at start (restart it, e.g. with a "
                                     "rolling restart of replicas, to take new ones); leave it out"),
    "kv_offloading_size": ((None,), "muxd keeps the KV cache on the GPU (no CPU offloading; --kv-cache-memory sizes "
                                    "it); leave it out"),
    "reasoning_parser_plugin": ((None,), "muxd loads no reasoning parser plugins; --reasoning-parser takes its "
                                         "built-in parsers"),
    "enable_mfu_metrics": ((False,), "muxd exports no MFU metrics (`muxd bench engine` times steps against ceilings "
                                     "measured in the same run); leave it out"),
    "kv_cache_metrics": ((False,), "muxd exports no KV cache residency metrics (vllm:kv_cache_usage_perc and the "
                                   "prefix cache's counters are at /metrics); leave it out"),
    "cudagraph_metrics": ((False,), "muxd exports no CUDA graph metrics (decode steps' wall and device times are in "
                                    "the step log: `muxd bench diagnose`); leave it out"),
    "enable_layerwise_nvtx_tracing": ((False,), "muxd adds no NVTX ranges (the executor's timeline is at "
                                                "/debug/timeline, and in --trace-dir); leave it out"),
    "enable_return_routed_experts": ((False,), "muxd serves dense models (Llama, Qwen2.5, Qwen3), without experts to "
                                               "route; leave it out"),
    "data_parallel_hybrid_lb": ((False,), "muxd serves replicas with --replicas N (one engine per GPU, on Ray Serve), "
                                          "not data parallelism"),
    "override_pooler_config": ((None,), "muxd serves text generation (no embedding, scoring or other pooling); leave "
                                        "it out"),
    "attention_config": ((None, "{}", ""), "muxd's attention is chosen by --attention-backend and --decode-kernel; "
                                           "leave it out"),
    "ec_transfer_config": ((None,), "muxd serves text-only models (no encoder cache to transfer); leave it out"),
}
PREFIX_HASH_ALGOS = ("builtin", "sha256", "sha256_cbor", "sha256_cbor_64bit", "xxhash", "xxhash_cbor")


def _structured_outputs_backend(text: str) -> str:
    """The backend of vLLM's --structured-outputs-config, which muxd takes only as auto or xgrammar."""
    value = json_object(text, "--structured-outputs-config", "structured-output settings")
    other = sorted(set(value) - {"backend"})
    if other:
        raise ConfigError(f"--structured-outputs-config: muxd takes only 'backend' (xgrammar); leave out "
                          f"{', '.join(map(repr, other))}")
    backend = value.get("backend", "auto")
    if backend not in ("auto", "xgrammar"):
        raise ConfigError(f"--structured-outputs-config: muxd's structured output runs on xgrammar; backend "
                          f"{backend!r} is not offered (give auto or xgrammar)")
    return backend


GROUPS: dict[str, type] = {"model": ModelSettings, "cache": CacheSettings, "scheduler": SchedulerSettings,
                           "runtime": RuntimeSettings, "parallel": ParallelSettings, "server": ServerSettings,
                           "vllm": VllmFlags}
_FIELD_GROUP = {f.name: group for group, cls in GROUPS.items() for f in dataclasses.fields(cls)}


@dataclass(frozen=True)
class Config:
    """Everything `muxd serve` was told, by group. `Config.flat(policy="mux", block_size=16)` builds one from field
    names alone (each belongs to exactly one group)."""

    model: ModelSettings = field(default_factory=ModelSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    vllm: VllmFlags = field(default_factory=VllmFlags)

    @classmethod
    def flat(cls, **values: Any) -> "Config":
        by_group: dict[str, dict[str, Any]] = {g: {} for g in GROUPS}
        for name, value in values.items():
            if name not in _FIELD_GROUP:
                raise ConfigError(f"unknown setting {name!r}; known: {', '.join(sorted(_FIELD_GROUP))}")
            by_group[_FIELD_GROUP[name]][name] = str(value) if isinstance(value, Path) else value
        return cls(**{g: GROUPS[g](**kw) for g, kw in by_group.items()})

    def replace(self, **values: Any) -> "Config":
        """A copy with some fields (by name, any group) changed."""
        groups = {g: getattr(self, g) for g in GROUPS}
        for name, value in values.items():
            if name not in _FIELD_GROUP:
                raise ConfigError(f"unknown setting {name!r}")
            g = _FIELD_GROUP[name]
            groups[g] = dataclasses.replace(groups[g], **{name: str(value) if isinstance(value, Path) else value})
        return Config(**groups)

    def prefill_graph_rows(self, model: ModelConfig | None = None) -> int:
        """--prefill-graph-rows, else `default_graph_rows(model)`, for chunked at most its step's budget. Launched
        eagerly, a prefill layer costs the host 3-4x what its graph replay does, up to 1.5 ms a layer while serving:
        chunked's mixed steps and mux's short prompts then wait for the host, not the GPU (mux on chat-short at 19.5
        req/s on an H200: 96.6 % of first tokens in time with graphs up to 512 rows, 100 % up to 2048)."""
        rows = self.runtime.prefill_graph_rows
        if rows is not None:
            return rows
        default = default_graph_rows(model)
        if self.scheduler.policy == "chunked":
            return min(default, self.scheduler.tuned_chunk_budget or default)
        return default

    def captured_graph_rows(self, model: ModelConfig | None = None) -> int:
        """The prefill graph rows an engine of `model` (one rank's share) on a GPU captures: `prefill_graph_rows`,
        never above a step's prefill tokens; 0 with --no-cuda-graph (the engine also needs CUDA and a graph-capable
        attention backend)."""
        if not self.runtime.cuda_graph:
            return 0
        return min(self.prefill_graph_rows(model), self.scheduler.max_num_batched_tokens)

    def resolved_dtype(self) -> str | None:
        """None keeps the checkpoint's dtype (GPU default); the CPU default is float32, which CPUs run fastest."""
        if self.model.dtype != "auto":
            return self.model.dtype
        return None if self.runtime.resolved_device().startswith("cuda") else "float32"

    def model_len(self, model: ModelConfig) -> int:
        """The context served: --max-model-len, else the model's (with vLLM's --disable-sliding-window, capped to a
        sliding window shorter than it, where full attention over the window is exact)."""
        if self.model.max_model_len:
            return self.model.max_model_len
        window = model.sliding_window
        if self.vllm.disable_sliding_window and window is not None:
            return min(model.max_model_len, window)
        return model.max_model_len

    def check(self) -> ModelConfig:
        """The checks that read files or the machine, before anything slow: the device (and GPUs enough for the
        ranks), the model directory and its config.json (and whether it splits across the ranks), the context length,
        the SLO contract, the weights (present, and each safetensors file whole), the tokenizer's special ids and chat
        template, the sampling defaults of generation_config.json. Returns the model's config as each rank runs it."""
        device = self.runtime.resolved_device()
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"--device {device}: no CUDA device is available on this machine")
        tp = self.parallel.tensor_parallel_size
        if tp > 1 and device.startswith("cuda"):
            if device != "cuda":
                raise ConfigError(f"--device {device} with --tensor-parallel-size {tp}: rank r runs on cuda:r; "
                                  "choose the GPUs with CUDA_VISIBLE_DEVICES and pass --device cuda")
            if torch.cuda.device_count() < tp:
                raise ConfigError(f"--tensor-parallel-size {tp} needs {tp} GPUs; this machine shows "
                                  f"{torch.cuda.device_count()}")
        if self.runtime.multiplex and not device.startswith("cuda"):
            raise ConfigError("--multiplex needs a CUDA device (SM partitions are green contexts of a GPU)")
        self.scheduler.contract  # every problem of the contract, with its line, before the model loads
        if not self.model.model_dir.exists():
            raise ModelLoadError(not_found(self.model.model, self.model.revision, self.model.download_dir))
        path = resolve_model_dir(self.model.model_dir)
        cfg = ModelConfig.from_file(path / "config.json", self.model.config_overrides()).sharded(tp)
        cfg.check_max_model_len(self.model_len(cfg))
        if self.model.load_format != "dummy":
            checkpoint_files(path, check=True)  # each file's header: a truncated download fails here, named
        if (path / "tokenizer.json").is_file():  # the template compiles, the special ids are token ids
            read_tokenizer_config(path, self.model.chat_template_source())
        elif self.model.chat_template is not None:
            raise ConfigError("--chat-template needs a tokenizer; this model directory has no tokenizer.json")
        tokenizer = self.vllm.tokenizer
        if tokenizer is not None and tokenizer != self.model.model and \
                Path(tokenizer).expanduser().resolve() != path.resolve():
            raise ConfigError(f"--tokenizer {tokenizer}: muxd reads the tokenizer from the model directory "
                              f"({path}); leave it out")
        if self.model.generation_config_dir is not None:  # the recommended sampling is in range
            read_sampling_defaults(self.model.generation_config_dir)
        return cfg

    def check_served_context(self, model: ModelConfig) -> None:
        """`muxd serve`: --max-model-len within the context the model is defined for (max_position_embeddings,
        stretched by rope scaling, as vLLM derives it); beyond it the model reads positions it was never trained on,
        so it is refused as `vllm serve` refuses it, unless vLLM's override VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 is set.
        (`muxd profile` times longer contexts on purpose, so this is not part of `check`.)"""
        asked = self.model.max_model_len
        if asked is not None and asked > model.max_model_len and os.environ.get(ALLOW_LONG_CONTEXT) != "1":
            raise ConfigError(f"--max-model-len {asked} exceeds this model's context of {model.max_model_len} tokens "
                              f"(config.json max_position_embeddings, with its rope scaling); serve at most "
                              f"{model.max_model_len}, or set {ALLOW_LONG_CONTEXT}=1 to serve longer sequences than "
                              "the model was trained on")
