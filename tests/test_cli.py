"""The muxd command line: help texts, version, generate, and clear errors for bad flags."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from appliance import __version__
from appliance.cli.main import app
from appliance.config import Config
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams

runner = CliRunner()


@pytest.fixture
def served(monkeypatch) -> dict:
    """What `muxd serve` would serve: seen["cfg"] is the Config it hands to create_app (no server starts)."""
    seen: dict = {}

    def fake_create_app(cfg, on_fatal=None):
        seen["cfg"] = cfg
        raise typer.Exit(0)

    monkeypatch.setattr("appliance.cli.serve.create_app", fake_create_app)
    return seen


def test_version_and_module_entry_point():
    assert runner.invoke(app, ["version"]).output.strip() == f"muxd {__version__}"
    out = subprocess.run([sys.executable, "-m", "appliance", "version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"muxd {__version__}"


@pytest.mark.parametrize("command, words", [
    ("serve", ["--model", "--host", "--port", "--dtype", "--load-format", "--max-num-seqs", "--kv-cache-memory",
               "--api-key", "MUXD_API_KEY", "--max-num-batched-tokens", "--block-size", "--seed", "--chat-template",
               "--enable-prefix-caching", "--no-enable-prefix-caching", "--max-request-bytes", "--shutdown-timeout",
               "--prefill-graph-rows", "--mixed-chunks", "--async-scheduling", "--no-async-scheduling"]),
    ("generate", ["prompt", "--max-tokens", "--temperature", "--chat", "--top-k", "--stop", "--system"]),
    ("version", ["version"]),
])
def test_help_lists_the_flags(command, words):
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for word in words:
        assert word in result.output


def test_generate_streams_text(text_checkpoint):
    result = runner.invoke(app, ["generate", "import os", "--model", str(text_checkpoint), "--max-tokens", "12"])
    assert result.exit_code == 0, result.output
    assert result.output.strip()


def test_generate_chat_mode(text_checkpoint):
    result = runner.invoke(app, ["generate", "hi", "--chat", "--model", str(text_checkpoint), "--max-tokens", "4",
                                 "--temperature", "0.8", "--seed", "3"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent/model"], "not found"),
    (["--dtype", "int3"], "int3"),
    (["--load-format", "pickle"], "--load-format"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
    (["--planner", "magic"], "--planner"),
    (["--port", "70000"], "--port"),
    (["--block-size", "0"], "--block-size"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["--prefill-graph-rows", "-1"], "--prefill-graph-rows must be >= 0"),
    (["--max-request-bytes", "lots"], "--max-request-bytes"),
    (["--api-key", " "], "--api-key"),
    (["--chat-template", "no/such/file.jinja"], "no such file"),
    (["--chat-template", "{% for m in messages %}"], "syntax error on line 1"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8: muxd keeps the KV cache in the model's dtype"),
    (["--quantization", "awq"], "--quantization awq: muxd serves unquantized checkpoints"),
    (["--tokenizer", "/some/other/dir"], "--tokenizer /some/other/dir: muxd reads the tokenizer from the model"),
    (["--enforce-eager", "--compile"], "--enforce-eager and --compile contradict"),
    (["--uvicorn-log-level", "loud"], "--uvicorn-log-level must be one of"),
    (["-pp", "2"], "--pipeline-parallel-size 2: muxd has no pipeline parallelism"),
    (["--data-parallel-size", "2"], "--data-parallel-size 2: muxd serves replicas with --replicas N"),
    (["--allowed-origins", "[https://app.example]"], "--allowed-origins: cannot read '[https://app.example]' as JSON"),
    (["--allowed-headers", "*"], "--allowed-headers: cannot read '*' as JSON"),
    (["--allowed-methods", '{"GET": 1}'], "--allowed-methods: '{\"GET\": 1}' is not a JSON list of strings"),
    (["--tokenizer-mode", "mistral"], "--tokenizer-mode mistral: muxd runs the model directory's fast tokenizer"),
    (["--tokenizer-mode", "slow"], "--tokenizer-mode slow: muxd runs the model directory's fast tokenizer"),
    (["--revision", "v1.1"], "--revision v1.1: muxd serves the model directory as it is and downloads nothing"),
    (["--root-path", "llm/"], "--root-path must start with / and not end with one"),
    (["--override-generation-config", "{temperature: 1}"], "--override-generation-config: cannot read"),
    (["--override-generation-config", '{"seed": 1}'], "'seed' not among the sampling fields"),
    (["--override-generation-config", '{"top_p": 0}'], "field 'top_p' is 0; expected a number > 0 and <= 1"),
    (["--override-generation-config", "[1]"], "expected a JSON object of generation config fields"),
    (["--distributed-executor-backend", "ray"], "--distributed-executor-backend ray: muxd starts one process"),
    (["--cpu-offload-gb", "4"], "--cpu-offload-gb 4: muxd keeps the weights on the GPU"),
    (["--compilation-config", '{"custom_ops": ["all"], "level": 3}'], "leave out 'custom_ops'"),
    (["--compilation-config", '{"cudagraph_mode": "BOTH"}'], "cudagraph_mode must be one of NONE, PIECEWISE"),
    (["--compilation-config", '{"cudagraph_capture_sizes": [0, 2]}'], "expected a list of batch sizes >= 1, got [0"),
    (["--compilation-config", '{"max_cudagraph_capture_size": 16}', "--max-graph-batch", "8"],
     "--compilation-config sets --max-cudagraph-capture-size to 16, the flag to 8"),
    (["--cudagraph-capture-sizes", "1", "2", "--max-cudagraph-capture-size", "4"],
     "--max-cudagraph-capture-size (--max-graph-batch) 4 is not the largest of --cudagraph-capture-sizes 1 2"),
    (["--cudagraph-capture-sizes", "0"], "--cudagraph-capture-sizes: expected a list of batch sizes >= 1"),
    (["--cuda-graph-sizes", "0"], "--cuda-graph-sizes: expected a list of batch sizes >= 1"),
    (["--cuda-graph-sizes", "4", "--max-cudagraph-capture-size", "8"],
     "--cuda-graph-sizes 4 (vLLM 0.9-0.10's --max-cudagraph-capture-size) contradicts --max-cudagraph-capture-size 8"),
    (["--cuda-graph-sizes", "1", "2", "--cudagraph-capture-sizes", "1", "4"],
     "--cuda-graph-sizes 1 2 (vLLM 0.9-0.10's --cudagraph-capture-sizes) contradicts --cudagraph-capture-sizes 1 4"),
    (["--lora-modules", "sql=/adapters/sql", "chat=/adapters/chat"],
     "--lora-modules sql=/adapters/sql chat=/adapters/chat: muxd serves one model without LoRA adapters"),
    (["--limit-mm-per-prompt", '{"image": 2}'], "muxd serves text-only models"),
    (["--otlp-traces-endpoint", "http://collector:4317"], "muxd exports no OpenTelemetry traces"),
    (["--task", "embed"], "--task embed: muxd serves text generation (no embedding"),
    (["--runner", "pooling"], "--runner pooling: muxd serves text generation"),
    (["--convert", "embed"], "--convert embed: muxd serves text generation and converts no model"),
    (["--scheduler-delay-factor", "0.5"], "--scheduler-delay-factor 0.5: --policy decides when prompts run"),
    (["--tokenizer-revision", "main"], "--tokenizer-revision main: muxd reads the tokenizer from the model directory"),
    (["--code-revision", "main"], "--code-revision main: muxd runs no code from model directories"),
    (["--enable-eplb"], "--enable-eplb: muxd serves dense models"),
    (["--enable-dbo"], "--enable-dbo: muxd has no dual-batch overlap"),
    (["--data-parallel-size-local", "2"], "--data-parallel-size-local 2: muxd serves replicas with --replicas N"),
    (["--tool-server", "demo"], "--tool-server demo: muxd runs no built-in tools"),
    (["--kv-sharing-fast-prefill"], "--kv-sharing-fast-prefill: muxd's models (Llama, Qwen2.5, Qwen3) share no KV"),
    (["--enable-ssl-refresh"], "--enable-ssl-refresh: muxd loads the TLS certificate and key at start"),
    (["--num-lookahead-slots", "2"], "--num-lookahead-slots 2: muxd has no speculative decoding"),
    (["--kv-offloading-size", "8"], "--kv-offloading-size 8: muxd keeps the KV cache on the GPU"),
    (["--reasoning-parser-plugin", "my.py"], "--reasoning-parser-plugin my.py: muxd loads no reasoning parser"),
    (["--enable-mfu-metrics"], "--enable-mfu-metrics: muxd exports no MFU metrics"),
    (["--kv-cache-metrics"], "--kv-cache-metrics: muxd exports no KV cache residency metrics"),
    (["--cudagraph-metrics"], "--cudagraph-metrics: muxd exports no CUDA graph metrics"),
    (["--enable-layerwise-nvtx-tracing"], "--enable-layerwise-nvtx-tracing: muxd adds no NVTX ranges"),
    (["--enable-return-routed-experts"], "--enable-return-routed-experts: muxd serves dense models"),
    (["--data-parallel-hybrid-lb"], "--data-parallel-hybrid-lb: muxd serves replicas with --replicas N"),
    (["--override-pooler-config", "{}"], "--override-pooler-config {}: muxd serves text generation"),
    (["--attention-config", '{"backend": "FLASH_ATTN"}'], "muxd's attention is chosen by --attention-backend"),
    (["--ec-transfer-config", "{}"], "--ec-transfer-config {}: muxd serves text-only models"),
    (["--pooler-config", "{}"], "--pooler-config {}: muxd serves text generation"),
    (["--hf-config-path", "/other/config"], "--hf-config-path /other/config: muxd reads config.json from the model"),
    (["--scheduler-cls", "my.Scheduler"], "--scheduler-cls my.Scheduler: muxd loads no scheduler class"),
    (["--config-format", "mistral"], "--config-format mistral: muxd reads the model's config.json"),
    (["--enable-expert-parallel"], "--enable-expert-parallel: muxd serves dense models"),
    (["--hf-overrides", "rope_theta=1e6"], "--hf-overrides: cannot read 'rope_theta=1e6' as JSON"),
    (["--rope-scaling", '{"factor": 4}', "--hf-overrides", '{"rope_scaling": null}'],
     "--rope-scaling and --hf-overrides set rope_scaling differently"),
    (["--num-scheduler-steps", "0"], "--num-scheduler-steps must be >= 1, got 0"),
    (["--middleware", "my.module.Middleware"], "--middleware my.module.Middleware: muxd loads no code named"),
    (["--logits-processors", "a.B", "c.D"], "--logits-processors a.B c.D: muxd runs no custom logits processors"),
    (["--kv-transfer-config", '{"kv_connector": "NixlConnector"}'], "muxd has no KV transfer between instances"),
    (["--kv-events-config", "{}"], "muxd publishes no KV cache events"),
    (["--model-loader-extra-config", '{"concurrency": 4}'], "muxd's loader takes no options"),
    (["--tokenizer-pool-size", "4"], "--tokenizer-pool-size 4: muxd tokenizes in its own process"),
    (["--collect-detailed-traces", "model", "worker"], "--collect-detailed-traces model worker: muxd exports no"),
    (["--tool-parser-plugin", "plugin.py"], "muxd loads no tool parser plugins"),
    (["--prefix-caching-hash-algo", "md5"], "--prefix-caching-hash-algo must be one of builtin, sha256"),
    (["--scheduling-policy", "priority"], "--scheduling-policy priority: muxd admits requests in arrival order"),
    (["--preemption-mode", "swap"], "--preemption-mode swap: muxd preempts by recomputing"),
    (["--long-prefill-token-threshold", "512"], "--long-prefill-token-threshold 512: --policy decides"),
    (["--speculative-config", '{"method": "ngram"}'], "muxd has no speculative decoding"),
    (["--enable-lora"], "--enable-lora: muxd serves one model without LoRA adapters"),
    (["--enable-sleep-mode"], "--enable-sleep-mode: muxd has no sleep mode"),
    (["--api-server-count", "4"], "--api-server-count 4: muxd runs one HTTP server per engine"),
    (["--model-impl", "transformers"], "--model-impl transformers: muxd runs its own model code"),
    (["--guided-decoding-backend", "outlines"], "--guided-decoding-backend outlines: muxd's structured output"),
    (["--structured-outputs-config", '{"backend": "guidance"}'], "backend 'guidance' is not offered"),
    (["--structured-outputs-config", '{"disable_fallback": true}'], "leave out 'disable_fallback'"),
    (["--max-log-len", "-1"], "--max-log-len must be >= 0, got -1"),
    (["--enable-prompt-embeds"], "not embeddings"),
    (["--skip-tokenizer-init"], "muxd tokenizes prompts and detokenizes outputs itself"),
    (["-q", "awq"], "--quantization awq: muxd serves unquantized checkpoints"),
    (["--attention-backend", "FLASH_ATTN"], "(of vLLM's backends muxd has FLASHINFER and TORCH_SDPA)"),
    (["--default-chat-template-kwargs", '{"messages": []}'], "--default-chat-template-kwargs may not set messages"),
    (["--default-chat-template-kwargs", "thinking"], "--default-chat-template-kwargs: cannot read 'thinking'"),
    (["--compilation-config", "fast"], "--compilation-config: cannot read 'fast' as a level or JSON"),
    (["-O0", "--compilation-config", "3"], "expected one level 0-3 (that -O does not contradict)"),
    (["-O5"], "-O (--optimization-level) must be 0, 1, 2 or 3, got 5"),
    (["-O0", "--compile"], "--enforce-eager and --compile contradict"),
    (["--response-role", "user"], "--response-role user: muxd's chat answers have the role assistant"),
    (["--chat-template-content-format", "openai"], "--chat-template-content-format openai: muxd hands message"),
    (["--max-logprobs", "5"], "--max-logprobs 5: muxd returns at most 20 alternatives per token"),
    (["--ssl-keyfile", __file__], "HTTPS needs both --ssl-keyfile and --ssl-certfile"),
    (["--ssl-keyfile", __file__, "--ssl-certfile", "/no/cert.pem"], "--ssl-certfile /no/cert.pem: no such file"),
    (["--h11-max-header-count", "0"], "--h11-max-header-count must be at least 1, got 0"),
    (["--stream-interval", "0"], "--stream-interval must be at least 1, got 0"),
    (["--headless"], "--headless: muxd has no multi-node data parallelism"),
    (["--log-config-file", "/no/such/logging.json"], "--log-config-file /no/such/logging.json: cannot be read"),
    (["--log-config-file", __file__], "not valid JSON"),
    (["--log-config-file", str(Path(__file__).resolve().parents[1] / "appliance" / "model_zoo" / "embedded" /
                               "config.json")], "with \"version\": 1"),
    (["--h11-max-incomplete-event-size", "-5"], "--h11-max-incomplete-event-size must be at least 1, got -5"),
    (["--ssl-cert-reqs", "2"], "--ssl-ca-certs, --ssl-cert-reqs and --ssl-ciphers apply to HTTPS"),
    (["--ssl-ciphers", "ECDHE+AESGCM"], "--ssl-ca-certs, --ssl-cert-reqs and --ssl-ciphers apply to HTTPS"),
    (["--ssl-keyfile", __file__, "--ssl-certfile", __file__, "--ssl-ciphers", "NO-SUCH-CIPHER"],
     "--ssl-ciphers NO-SUCH-CIPHER: OpenSSL knows no cipher of that list"),
    (["--ssl-keyfile", __file__, "--ssl-certfile", __file__, "--ssl-cert-reqs", "3"], "--ssl-cert-reqs must be 0"),
    (["--uds", "/tmp/m.sock", "--replicas", "2"], "--ssl-keyfile/--ssl-certfile and --uds apply to one server"),
    (["--model", str(Path(__file__).resolve().parents[1] / "configs" / "models" / "llama-3.1-8b")],
     "--load-format dummy"),
])
def test_serve_rejects_bad_flags_before_starting(text_checkpoint, args, message):
    if "--model" not in args:
        args = ["--model", str(text_checkpoint), *args]
    result = runner.invoke(app, ["serve", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_serve_flags_reach_the_server_config(text_checkpoint, tmp_path, served):
    seen = served
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    result = runner.invoke(app, [
        "serve", "--model", str(text_checkpoint), "--max-num-batched-tokens", "64", "--block-size", "8", "--seed", "7",
        "--chat-template", str(template), "--no-enable-prefix-caching", "--max-request-bytes", "2MiB",
        "--shutdown-timeout", "5"], env={"MUXD_API_KEY": "sk-from-env"})
    assert result.exit_code == 0, result.output
    cfg = seen["cfg"]
    assert (cfg.server.api_key, cfg.model.seed, cfg.server.shutdown_timeout, cfg.server.request_byte_limit) == (
        "sk-from-env", 7, 5, 2 << 20)
    assert cfg.model.chat_template_source() == template.read_text()
    assert (cfg.scheduler.max_num_batched_tokens, cfg.cache.block_size, cfg.cache.enable_prefix_caching) == (
        64, 8, False)

    for flags, caching in ([], True), (["--no-prefix-caching"], False), (["--enable-prefix-caching"], True):
        assert runner.invoke(app, ["serve", "--model", str(text_checkpoint), *flags]).exit_code == 0
        assert seen["cfg"].cache.enable_prefix_caching is caching
    inline = "{{ messages[0]['content'] }}"
    assert runner.invoke(app, ["serve", "--model", str(text_checkpoint), "--chat-template", inline]).exit_code == 0
    assert seen["cfg"].model.chat_template_source() == inline


def test_a_context_beyond_the_model_needs_vllms_override(text_checkpoint, monkeypatch, served):
    """As `vllm serve`: --max-model-len above the model's context starts only with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."""
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    args = ["serve", str(text_checkpoint), "--max-model-len", "4096"]
    refused = runner.invoke(app, args)
    assert refused.exit_code == 2 and "--max-model-len 4096 exceeds this model's context of 512 tokens" in \
        refused.output.replace("\n", " ")
    assert runner.invoke(app, args, env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}).exit_code == 0
    assert runner.invoke(app, ["serve", str(text_checkpoint), "--max-model-len", "512"]).exit_code == 0


def test_a_vllm_command_line_starts_muxd_unchanged(text_checkpoint, served):
    """`vllm serve`'s common flags are taken: those that ask for nothing muxd does differently are accepted, and
    --enforce-eager turns off CUDA graphs and torch.compile."""
    seen = served
    model = str(text_checkpoint)
    result = runner.invoke(app, [
        "serve", model, "--tokenizer", model, "--trust-remote-code", "--enforce-eager", "--disable-log-requests",
        "--disable-log-stats", "--enable-chunked-prefill", "--swap-space", "4", "--kv-cache-dtype", "auto",
        "--uvicorn-log-level", "warning", "--gpu-memory-utilization", "0.9", "--max-model-len", "256",
        "--served-model-name", "m", "--generation-config", "vllm", "--reasoning-parser", "qwen3",
        "--pipeline-parallel-size", "1", "--data-parallel-size", "1", "--max-log-len", "100", "--tokenizer-mode",
        "auto", "--download-dir", "/models", "--no-enable-log-requests", "--allowed-origins", '["https://a.example"]',
        "--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["*"]', "--allow-credentials"])
    assert result.exit_code == 0, result.output
    cfg = seen["cfg"]
    assert (cfg.runtime.cuda_graph, cfg.runtime.compile, cfg.vllm.uvicorn_log_level) == (False, False, "warning")
    assert cfg.server.cors() == {"allow_origins": ["https://a.example"], "allow_methods": ["GET", "POST"],
                                 "allow_headers": ["*"], "allow_credentials": True}
    assert runner.invoke(app, ["serve", model, "--tokenizer-mode", "hf"]).exit_code == 0
    assert runner.invoke(app, ["serve", model, "--response-role", "assistant", "--chat-template-content-format",
                               "string", "--max-logprobs", "20", "--return-tokens-as-token-ids",
                               "--enable-request-id-headers", "--enable-prompt-tokens-details",
                               "--disable-frontend-multiprocessing", "--disable-custom-all-reduce",
                               "--max-seq-len-to-capture", "8192", "--distributed-executor-backend", "mp",
                               "--cpu-offload-gb", "0", "--enable-force-include-usage"]).exit_code == 0
    assert seen["cfg"].vllm.return_tokens_as_token_ids and seen["cfg"].vllm.enable_request_id_headers
    # more of vLLM's flags at the values that ask for nothing muxd does differently
    assert runner.invoke(app, ["serve", model, "--scheduling-policy", "fcfs", "--preemption-mode", "recompute",
                               "--long-prefill-token-threshold", "0", "--max-num-partial-prefills", "1",
                               "--max-long-partial-prefills", "1", "--disable-cascade-attn",
                               "--max-parallel-loading-workers", "4", "--model-impl", "auto", "--api-server-count", "1",
                               "--show-hidden-metrics-for-version", "0.10", "--guided-decoding-backend", "xgrammar",
                               "--structured-outputs-config", '{"backend": "auto"}', "--attention-backend",
                               "FLASHINFER", "--kv-cache-memory-bytes", "1000000",
                               "--default-chat-template-kwargs", '{"enable_thinking": false}',
                               "--enable-server-load-tracking", "--task", "generate", "--runner", "generate",
                               "--convert", "none", "--enable-reasoning", "--disable-sliding-window",
                               "--num-scheduler-steps", "8", "--multi-step-stream-outputs", "--use-v2-block-manager",
                               "--scheduler-delay-factor", "0", "--config-format", "hf", "--max-loras", "4",
                               "--max-lora-rank", "64", "--max-cpu-loras", "8", "--lora-dtype", "auto",
                               "--log-error-stack", "--hf-overrides", '{"max_position_embeddings": 1024}',
                               "--rope-theta", "1e6", "--prefix-caching-hash-algo", "xxhash",
                               "--allowed-local-media-path", "/srv/media", "--allowed-media-domains", "example.com",
                               "example.org", "--calculate-kv-scales", "--use-tqdm-on-load", "--ignore-patterns",
                               "original/**/*", "*.pt", "--model-loader-extra-config", "{}", "--tokenizer-pool-size",
                               "0", "--logits-processor-pattern", "my_pkg\\..*", "--hf-token", "hf_abc",
                               "--scheduler-cls", "vllm.v1.core.sched.scheduler.Scheduler", "--logprobs-mode",
                               "processed_logprobs", "--exclude-tools-when-tool-choice-none",
                               "--mm-processor-cache-gb", "4", "--skip-mm-profiling", "--mm-encoder-tp-mode", "data",
                               "--disable-hybrid-kv-cache-manager", "--safetensors-load-strategy", "lazy",
                               "--pt-load-map-location", "cpu", "--stream-interval", "4",
                               "--data-parallel-size-local", "1", "--disable-chunked-mm-input",
                               "--guided-decoding-disable-fallback", "--aggregate-engine-logging",
                               "--num-lookahead-slots", "0", "--attention-config", "{}"]).exit_code == 0
    more = seen["cfg"]
    assert more.server.exclude_tools_when_tool_choice_none and more.server.stream_interval == 4
    assert more.model.logprobs_mode == "processed_logprobs"
    assert more.vllm.ignore_patterns == ["original/**/*", "*.pt"]
    assert (more.runtime.attention_backend, more.cache.kv_cache_memory, more.model.template_defaults(),
            more.vllm.enable_server_load_tracking, more.model.config_overrides()) == (
        "flashinfer", "1000000", {"enable_thinking": False}, True,
        {"max_position_embeddings": 1024, "rope_theta": 1e6})
    for level, eager in (("-O0", True), ("-O3", False), ("--optimization-level=1", False),
                         ("--compilation-config=0", True), ('--compilation-config={"level": 3}', False)):
        assert runner.invoke(app, ["serve", model, level]).exit_code == 0
        assert (seen["cfg"].runtime.enforce_eager, seen["cfg"].runtime.cuda_graph) == (eager, not eager)
    # vLLM's CUDA-graph settings: the capture sizes (several values after the flag), the largest one, the mode
    for args, sizes, largest, graphs, prefill_rows in (
            (["--cudagraph-capture-sizes", "8", "1", "2", "--port", "9"], (1, 2, 8), None, True, None),
            (["--max-cudagraph-capture-size", "32"], None, 32, True, None),
            (["--cuda-graph-sizes", "16"], None, 16, True, None),  # vLLM 0.9-0.10: one value, the largest
            (["--cuda-graph-sizes", "4", "1", "--port", "9"], (1, 4), None, True, None),  # several: the sizes
            (["--cuda-graph-sizes", "1", "4", "--cudagraph-capture-sizes", "4", "1"], (1, 4), None, True, None),
            (["--compilation-config", '{"cudagraph_capture_sizes": [4, 1], "max_cudagraph_capture_size": 4, '
              '"cudagraph_mode": "FULL_AND_PIECEWISE"}'], (1, 4), 4, True, None),
            (["--compilation-config", '{"cudagraph_mode": "FULL_DECODE_ONLY", "level": 3}'], None, None, True, 0),
            (["--compilation-config", '{"cudagraph_mode": "none"}'], None, None, False, None)):
        assert runner.invoke(app, ["serve", model, *args]).exit_code == 0, args
        rt = seen["cfg"].runtime
        assert (rt.cudagraph_capture_sizes, rt.max_graph_batch, rt.cuda_graph, rt.prefill_graph_rows) == (
            sizes, largest, graphs, prefill_rows), args
    assert (cfg.model.served_model_name, cfg.model.generation_config, cfg.server.reasoning_parser) == (
        ("m",), "vllm", "qwen3")
    assert "--trust-remote-code" not in runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "300"}).output
    # several names after one flag, as vLLM's nargs="+", up to the next flag; a model directory among them is refused
    assert runner.invoke(app, ["serve", model, "--served-model-name", "a", "org/b", "--port", "9"]).exit_code == 0
    cfg = seen["cfg"]
    assert (cfg.model.served_model_name, cfg.server.port, cfg.model.model) == (("a", "org/b"), 9, model)
    swallowed = runner.invoke(app, ["serve", "--served-model-name", "a", model])
    assert swallowed.exit_code == 2 and f"--served-model-name took the model directory {model!r} as a name" in \
        swallowed.output.replace("\n", "")


def test_override_generation_config_replaces_or_adds_to_the_defaults(text_checkpoint, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    common = dict(model=str(text_checkpoint), override_generation_config='{"max_new_tokens": 9, "top_k": 50}')
    # an override at transformers' default (top_k 50) still applies: it was asked for
    assert Config.flat(**common, generation_config=str(tmp_path)).model.sampling_defaults() == {
        "temperature": 0.0, "max_tokens": 9, "top_k": 50}
    assert Config.flat(**common, generation_config="vllm").model.sampling_defaults() == {"max_tokens": 9, "top_k": 50}
    assert Config.flat(model=str(text_checkpoint), generation_config="vllm").model.sampling_defaults() == {}


def test_a_vllm_config_file_and_human_readable_integers(text_checkpoint, tmp_path, served):
    """`--config FILE` (vLLM's): YAML of long flag names, the command line winning where both set a flag (MODEL over
    the file's model); --max-model-len and --max-num-batched-tokens take vLLM's 1k / 2K forms."""
    seen = served
    config = tmp_path / "serve.yaml"
    config.write_text("model: /not/this/one\nport: 8123\nmax_model_len: 0.25k\nserved-model-name: [a, b]\n"
                      "enable-prefix-caching: false\nallowed-origins: ['https://x.example']\nhost: 0.0.0.0\n")
    model = str(text_checkpoint)
    result = runner.invoke(app, ["serve", model, "--config", str(config), "--port", "9000",
                                 "--max-num-batched-tokens", "2K"])
    assert result.exit_code == 0, result.output
    cfg = seen["cfg"]
    assert (cfg.model.model, cfg.server.port, cfg.server.host, cfg.model.max_model_len) == (model, 9000, "0.0.0.0", 250)
    assert (cfg.model.served_model_name, cfg.cache.enable_prefix_caching, cfg.scheduler.max_num_batched_tokens) == (
        ("a", "b"), False, 2048)
    assert cfg.server.cors()["allow_origins"] == ["https://x.example"]
    config.write_text("max-model-lenn: 10\n")
    typo = runner.invoke(app, ["serve", model, "--config", str(config)], env={"COLUMNS": "300"})
    assert typo.exit_code == 2 and "'max-model-lenn' is not a flag of `muxd serve`" in typo.output
    half = runner.invoke(app, ["serve", model, "--max-model-len", "1.5K"], env={"COLUMNS": "300"})
    assert half.exit_code == 2 and "1.5K: a binary suffix (K) takes a whole number" in half.output


@pytest.fixture
def uvicorn_config(monkeypatch) -> dict:
    """{"uvicorn": the uvicorn.Config of the latest `muxd serve` invoked}, whose server is not run."""
    seen = {}

    class FakeServer:
        def __init__(self, config, state, shutdown_timeout):
            seen["uvicorn"] = config

        def run(self):
            pass

    monkeypatch.setattr("appliance.cli.serve.DrainingServer", FakeServer)
    return seen


def test_vllm_server_flags_reach_uvicorn_and_the_app(text_checkpoint, uvicorn_config):
    """--disable-uvicorn-access-log turns uvicorn's access log off, --disable-fastapi-docs removes /docs, /redoc and
    /openapi.json, --root-path is the app's root_path; without them, all three are as uvicorn and FastAPI default."""
    import logging

    seen = uvicorn_config
    assert runner.invoke(app, ["serve", str(text_checkpoint)]).exit_code == 0
    default = seen["uvicorn"]
    paths = {getattr(route, "path", None) for route in default.app.routes}
    assert default.access_log and {"/docs", "/redoc", "/openapi.json"} <= paths and default.app.root_path == ""
    assert "/tokenizer_info" not in paths and default.h11_max_incomplete_event_size is None
    assert default.http.keywords["max_header_count"] == 256  # (vLLM's default)
    result = runner.invoke(app, ["serve", str(text_checkpoint), "--disable-uvicorn-access-log",
                                 "--disable-fastapi-docs", "--root-path", "/llm", "--enable-tokenizer-info-endpoint",
                                 "--h11-max-incomplete-event-size", "4194304", "--h11-max-header-count", "100"])
    assert result.exit_code == 0, result.output
    off = seen["uvicorn"]
    assert off.access_log is False and not logging.getLogger("uvicorn.access").handlers
    assert not {"/docs", "/redoc", "/openapi.json"} & {getattr(route, "path", None) for route in off.app.routes}
    assert off.app.root_path == "/llm"
    assert "/tokenizer_info" in {getattr(route, "path", None) for route in off.app.routes}
    assert off.h11_max_incomplete_event_size == 4194304 and off.http.keywords["max_header_count"] == 100


def test_access_log_leaves_out_the_paths_asked(text_checkpoint, uvicorn_config):
    """vLLM's --disable-access-log-for-endpoints (comma-separated paths) and --disable-uvicorn-metrics-access-log
    (/health and /metrics): uvicorn's access log drops those requests, whatever their query string."""
    import logging

    from appliance.server.http import QuietPaths

    logger = logging.getLogger("uvicorn.access")

    def logged(path: str) -> bool:
        record = logger.makeRecord("uvicorn.access", logging.INFO, __file__, 0, '%s - "%s %s HTTP/%s" %d',
                                   ("127.0.0.1:5000", "GET", path, "1.1", 200), None)
        return logger.filter(record)

    try:
        result = runner.invoke(app, ["serve", str(text_checkpoint), "--disable-access-log-for-endpoints",
                                     " /v1/models, /ready,", "--disable-uvicorn-metrics-access-log"])
        assert result.exit_code == 0, result.output
        assert not any(logged(p) for p in ("/v1/models", "/ready?x=1", "/health", "/metrics"))
        assert logged("/v1/completions") and logged("/v1/models/extra")
    finally:
        for f in [f for f in logger.filters if isinstance(f, QuietPaths)]:
            logger.removeFilter(f)
    result = runner.invoke(app, ["serve", str(text_checkpoint), "--disable-access-log-for-endpoints", "health"])
    assert result.exit_code == 2 and "takes paths starting with / (e.g. /health,/metrics), got 'health'" in \
        result.output


def test_log_config_file_configures_the_loggers_and_reaches_uvicorn(text_checkpoint, uvicorn_config, tmp_path):
    """vLLM's --log-config-file: a dictConfig JSON applied at start and handed to uvicorn; one that logging cannot
    apply stops the start naming the flag."""
    import json
    import logging

    seen = uvicorn_config
    log_file = tmp_path / "muxd.log"
    config = {"version": 1, "disable_existing_loggers": False,
              "handlers": {"file": {"class": "logging.FileHandler", "filename": str(log_file)}},
              "loggers": {"muxd.logtest": {"handlers": ["file"], "level": "WARNING", "propagate": False}}}
    path = tmp_path / "logging.json"
    path.write_text(json.dumps(config))
    result = runner.invoke(app, ["serve", str(text_checkpoint), "--log-config-file", str(path)])
    assert result.exit_code == 0, result.output
    logger = logging.getLogger("muxd.logtest")
    try:
        assert seen["uvicorn"].log_config == config and logger.level == logging.WARNING
        logger.warning("written by the configured handler")
        logger.info("below the configured level")
        for handler in logger.handlers:
            handler.flush()
        assert log_file.read_text() == "written by the configured handler\n"
    finally:
        for handler in list(logger.handlers):
            handler.close()
            logger.removeHandler(handler)
    config["handlers"]["file"]["class"] = "logging.NoSuchHandler"
    path.write_text(json.dumps(config))
    result = runner.invoke(app, ["serve", str(text_checkpoint), "--log-config-file", str(path)])
    assert result.exit_code == 2 and f"--log-config-file {path}: Unable to configure handler" in result.output


def test_seed_flag_makes_unseeded_sampling_repeat(text_checkpoint):
    def sample(seed: int) -> list[int]:
        engine = build_engine(Config.flat(model=str(text_checkpoint), seed=seed, max_num_seqs=2))
        params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)  # no per-request seed
        return [c.token_ids for c in engine.generate(["import os", "def f"], params)]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_generate_top_k_stop_and_system(text_checkpoint):
    model = ["--model", str(text_checkpoint), "--max-tokens", "16"]
    greedy = runner.invoke(app, ["generate", "import os", *model]).output
    assert runner.invoke(app, ["generate", "import os", *model, "--temperature", "1", "--top-k", "1"]).output == greedy
    text = greedy.rstrip("\n")
    stop = text[len(text) // 2:len(text) // 2 + 2]
    stopped = runner.invoke(app, ["generate", "import os", *model, "--stop", stop]).output.rstrip("\n")
    assert stopped == text[:text.index(stop)]

    engine = build_engine(Config.flat(model=str(text_checkpoint)))
    rendered = engine.tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": "hi"}])
    expected = engine.generate(engine.tokenizer.encode(rendered, add_special_tokens=False),
                               SamplingParams(max_tokens=16, temperature=0))[0].text
    with_system = runner.invoke(app, ["generate", "hi", *model, "--system", "Be brief."])
    assert with_system.exit_code == 0 and with_system.output == expected + "\n"


@pytest.mark.parametrize("args", [["-h"], ["serve", "-h"], ["bench", "-h"], ["bench", "sweep", "-h"], ["slo", "-h"],
                                  ["profile", "-h"], ["generate", "-h"]])
def test_short_help_everywhere(args):
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "Usage:" in result.output


def test_version_flag():
    for flag in ("--version", "-V"):
        result = runner.invoke(app, [flag])
        assert result.exit_code == 0 and result.output.strip() == f"muxd {__version__}"


def test_serve_takes_the_model_as_positional_argument(text_checkpoint, served):
    seen = served
    assert runner.invoke(app, ["serve", str(text_checkpoint), "--block-size", "8"]).exit_code == 0
    assert seen["cfg"].model.model == str(text_checkpoint) and seen["cfg"].cache.block_size == 8
    same = runner.invoke(app, ["serve", str(text_checkpoint), "--model", str(text_checkpoint)])
    assert same.exit_code == 0
    clash = runner.invoke(app, ["serve", str(text_checkpoint), "--model", "/elsewhere"])
    assert clash.exit_code == 2 and "given twice" in clash.output


def test_bench_takes_vllm_flag_names(monkeypatch, tmp_path):
    seen = {}

    def fake_bench(ctx, opts):
        seen["opts"] = opts

    from appliance.cli import bench as bench_cli

    monkeypatch.setattr(bench_cli, "_run_bench", fake_bench, raising=True)
    result = runner.invoke(app, ["bench", "--base-url", "http://127.0.0.1:9", "--dataset-name", "random",
                                 "--random-input-len", "32", "--random-output-len", "8", "--save-result",
                                 "--result-filename", "r.json", "--percentile-metrics", "ttft,itl",
                                 "--tokenizer", "embedded"])
    assert result.exit_code == 0, result.output
    opts = seen["opts"]
    assert (opts.url, opts.trace, opts.input_len, opts.output_len) == ("http://127.0.0.1:9", None, "32", "8")
    assert (opts.result_dir, opts.result_filename, opts.percentile_metrics) == (Path("."), "r.json", ("ttft", "itl"))
    bad = runner.invoke(app, ["bench", "--percentile-metrics", "ttft,latency"])
    assert bad.exit_code == 2 and "latency" in bad.output
    spread = runner.invoke(app, ["bench", "--base-url", "http://127.0.0.1:9", "--dataset-name", "random",
                                 "--random-input-len", "1000", "--random-output-len", "10", "--random-range-ratio",
                                 "0.25", "--tokenizer", "embedded"])
    assert spread.exit_code == 0, spread.output
    assert (seen["opts"].input_len, seen["opts"].output_len) == ("uniform:750:1250", "uniform:7:13")
    chat = runner.invoke(app, ["bench", "--base-url", "http://127.0.0.1:9", "--backend", "openai-chat", "--top-p",
                               "0.9", "--top-k", "5", "--tokenizer", "embedded"])
    assert chat.exit_code == 0, chat.output
    assert (seen["opts"].endpoint, seen["opts"].sampling) == ("chat", {"top_p": 0.9, "top_k": 5})
    shared = runner.invoke(app, ["bench", "--base-url", "http://127.0.0.1:9", "--dataset-name", "random",
                                 "--random-prefix-len", "100", "--tokenizer", "embedded"])
    assert shared.exit_code == 0 and seen["opts"].prefix_len == 100, shared.output
    for args, named in ((["--random-range-ratio", "1"], "[0, 1)"), (["--random-prefix-len", "-1"], ">= 0"),
                        (["--dataset-path", "t.csv", "--random-prefix-len", "8"], "trace"),
                        (["--random-input-len", "lognormal:100:0.5", "--random-range-ratio", "0.1"], "lognormal"),
                        (["--dataset-path", "t.csv", "--random-range-ratio", "0.1"], "trace")):
        refused = runner.invoke(app, ["bench", "--base-url", "http://127.0.0.1:9", *args])
        assert refused.exit_code == 2 and named in refused.output, refused.output


def test_several_value_flags_given_no_values_are_unset():
    """A flag of several values that is not given reaches the config as an empty list (typer) or tuple (serve args
    read back from a config): either is unset, not a value to refuse."""
    for empty in ([], ()):
        cfg = Config.flat(lora_modules=empty, cuda_graph_sizes=empty, middleware=empty, logits_processors=empty)
        assert (cfg.vllm.lora_modules, cfg.runtime.max_graph_batch, cfg.runtime.cudagraph_capture_sizes,
                cfg.vllm.middleware, cfg.vllm.logits_processors) == (None, None, None, None, None)
