"""The `muxd` command line: serve (OpenAI-compatible server), generate (one prompt, streamed to the terminal),
bench (appliance/bench/cli.py), profile (appliance/multiplex/profile_cli.py), slo, version. Flags become one ServeConfig, validated before anything slow happens.
"""
from __future__ import annotations

import logging
import sys
from typing import Optional

import typer

from appliance import __version__
from appliance.bench.cli import app as bench_app
from appliance.bench.compare_cli import compare_command, pool_command
from appliance.bench.engine_cli import engine_bench_command
from appliance.config import ServeConfig
from appliance.errors import ApplianceError
from appliance.multiplex.profile_cli import profile_command
from appliance.slo.cli import app as slo_app

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="muxd: an LLM serving appliance with an OpenAI-compatible API.")
engine_bench_command(bench_app)  # `muxd bench engine` joins the bench group
compare_command(bench_app)  # and `muxd bench compare`
pool_command(bench_app)  # and `muxd bench pool`
app.add_typer(bench_app, name="bench")
app.add_typer(slo_app, name="slo")
profile_command(app)

MODEL_HELP = "Hugging Face model directory (config.json, safetensors, tokenizer.json), or 'embedded' for the small " \
             "model shipped inside muxd."


def _fail(exc: ApplianceError) -> None:
    typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


@app.command()
def serve(
    model: str = typer.Option("embedded", "--model", "-m", help=MODEL_HELP),
    host: str = typer.Option("127.0.0.1", envvar="MUXD_HOST", help="Address to bind; use 0.0.0.0 to accept "
                                                                   "connections from other machines."),
    port: int = typer.Option(8000, envvar="MUXD_PORT", help="TCP port."),
    served_model_name: Optional[str] = typer.Option(None, help="Model name clients send in 'model' (default: "
                                                               "the directory name, or muxd-embedded)."),
    dtype: str = typer.Option("auto", help="Weights and KV dtype: auto (checkpoint's on GPU, float32 on CPU), "
                                           "bfloat16, float16, float32."),
    load_format: str = typer.Option("auto", help="auto/safetensors reads the weights; dummy draws random ones of "
                                                 "the right shapes (for benchmarking without a checkpoint)."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
    max_num_seqs: int = typer.Option(256, help="Requests prefilling or decoding at once."),
    max_model_len: Optional[int] = typer.Option(None, help="Prompt + output tokens per request (default: the "
                                                           "model's limit, capped by the KV cache)."),
    kv_cache_memory: Optional[str] = typer.Option(None, help="KV-cache size, e.g. 8GiB (default: what "
                                                             "--gpu-memory-utilization leaves on GPU, 512MiB on CPU)."),
    gpu_memory_utilization: float = typer.Option(0.9, help="Fraction of GPU memory muxd may use in total."),
    max_waiting: int = typer.Option(4096, help="Queued requests beyond which new ones get HTTP 429."),
    enable_prefix_caching: bool = typer.Option(True, "--enable-prefix-caching/--no-enable-prefix-caching",
                                               help="Reuse KV pages of equal prompt prefixes."),
    no_prefix_caching: bool = typer.Option(False, "--no-prefix-caching", help="Same as --no-enable-prefix-caching."),
    max_num_batched_tokens: int = typer.Option(8192, help="Prompt tokens prefilled per engine step (a longer "
                                                          "prompt still runs, alone)."),
    block_size: int = typer.Option(16, help="Tokens per KV-cache page."),
    seed: Optional[int] = typer.Option(None, help="Seed the sampling generator once at start-up, as vLLM does: "
                                                  "the same requests in the same order sample the same tokens. A "
                                                  "request's own 'seed' fixes its output regardless."),
    chat_template: Optional[str] = typer.Option(None, help="Chat template to use instead of the model's: a file, "
                                                           "or the jinja template itself."),
    api_key: Optional[str] = typer.Option(None, envvar="MUXD_API_KEY", show_envvar=True,
                                          help="Require 'Authorization: Bearer KEY' on every /v1 route (/health, "
                                               "/ready and /metrics stay open)."),
    max_request_bytes: str = typer.Option("16MiB", help="Largest request body (e.g. 16MiB or 1048576); larger "
                                                        "ones get HTTP 413."),
    shutdown_timeout: float = typer.Option(30.0, help="On SIGTERM/SIGINT, seconds running requests may take to "
                                                      "finish (new ones get 503) before they are ended."),
    planner: str = typer.Option("serial", "--policy", "--planner",
                                help="Scheduling policy: mux (SLO-aware multiplexing), chunked (Sarathi-style token "
                                     "budget, the vLLM/SGLang default), serial (prefill first) or layerwise."),
    slo: Optional[str] = typer.Option(None, help="SLO contract (YAML, see configs/slo/); default: p99 TBT 50 ms."),
    profile: Optional[str] = typer.Option(None, help="Latency profile of this model on this GPU for --policy mux "
                                                     "(and chunked's budget); missing or mismatched: the roofline "
                                                     "prior (with a warning)."),
    chunk_budget: Optional[int] = typer.Option(None, help="Tokens per step for --policy chunked (default: with "
                                                          "--profile, the largest whose step meets the contract's "
                                                          "TBT target; without, --max-num-batched-tokens)."),
    attention_backend: str = typer.Option("auto", help="auto (flashinfer on CUDA where it supports the model, "
                                                       "else torch), flashinfer or torch."),
    compile: Optional[bool] = typer.Option(None, "--compile/--no-compile", help="torch.compile each decoder layer "
                                           "(default: on with CUDA, off on CPU)."),
    cuda_graph: bool = typer.Option(True, "--cuda-graph/--no-cuda-graph", help="Replay decode steps as CUDA "
                                    "graphs (CUDA with the flashinfer backend); off for debugging."),
    prefill_graph_rows: int = typer.Option(512, help="Prefill launches and chunked prefill's mixed steps of up to "
                                           "this many tokens replay piecewise CUDA graphs (attention eager between "
                                           "them, as in vLLM); 0: off."),
    multiplex: Optional[bool] = typer.Option(None, "--multiplex/--no-multiplex", help="Run prefill and decode at "
                                             "once on disjoint SM partitions (default: on with CUDA for the mux and "
                                             "layerwise policies)."),
    partition_granularity: int = typer.Option(16, help="Decode partitions are multiples of this many SMs (a "
                                                       "multiple of 8 on Hopper)."),
    layerwise_decode_sms: int = typer.Option(64, help="SMs the layerwise policy gives decode while prefill runs."),
    preemption: bool = typer.Option(True, "--preemption/--no-preemption", help="mux: a short prompt may preempt "
                                    "a long prefill between layers."),
    mixed_chunks: bool = typer.Option(False, "--mixed-chunks/--no-mixed-chunks", help="mux: run a chunk of the "
                                      "prompt beside the decode rows on all SMs, sized to the TBT target, whenever "
                                      "the profile predicts it prefills faster than the SM split (adaptive chunked "
                                      "prefill)."),
    trace_dir: Optional[str] = typer.Option(None, help="Write the executor's timeline (Chrome-trace JSON) here "
                                                       "when the server stops; GET /debug/timeline serves it live."),
    log_level: str = typer.Option("info", help="debug, info, warning, error."),
) -> None:
    """Start the OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /health,
    /ready, /metrics)."""
    import uvicorn

    from appliance.server.api import create_app
    from appliance.server.lifecycle import DrainingServer

    cfg = ServeConfig(model=model, served_model_name=served_model_name, host=host, port=port, device=device,
                      dtype=dtype, load_format=load_format, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                      kv_cache_memory=kv_cache_memory, gpu_memory_utilization=gpu_memory_utilization,
                      enable_prefix_caching=enable_prefix_caching and not no_prefix_caching, planner=planner,
                      max_waiting=max_waiting, slo=slo, profile=profile, chunk_budget=chunk_budget,
                      max_num_batched_tokens=max_num_batched_tokens, page_size=block_size, seed=seed,
                      chat_template=chat_template, api_key=api_key, max_request_bytes=max_request_bytes,
                      shutdown_timeout=shutdown_timeout, attention_backend=attention_backend, compile=compile,
                      cuda_graph=cuda_graph, prefill_graph_rows=prefill_graph_rows, multiplex=multiplex, partition_granularity=partition_granularity,
                      layerwise_decode_sms=layerwise_decode_sms, preemption=preemption, mixed_chunks=mixed_chunks,
                      trace_dir=trace_dir)
    try:
        cfg.validate()
    except ApplianceError as exc:
        _fail(exc)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    fatal: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_fatal(exc: BaseException) -> None:
        fatal.append(exc)
        if server is not None:
            server.should_exit = True

    app = create_app(cfg, on_fatal)
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=5), app.state.muxd, shutdown_timeout)
    typer.echo(f"muxd {__version__}: serving {cfg.model_name} on http://{host}:{port} (loading the model; "
               "GET /ready turns 200 when it is up)")
    server.run()
    if fatal:
        typer.secho(f"error: start-up failed: {fatal[0]}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=1)


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="Prompt text."),
    model: str = typer.Option("embedded", "--model", "-m", help=MODEL_HELP),
    max_tokens: int = typer.Option(64, help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, help="0 for greedy decoding."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass."),
    top_k: int = typer.Option(-1, help="Sample among the k most likely tokens only (-1: no cut)."),
    stop: Optional[list[str]] = typer.Option(None, help="Stop before this text (repeat the flag for several)."),
    seed: Optional[int] = typer.Option(None, help="Seed for reproducible sampling."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt as a user message in the chat template."),
    system: Optional[str] = typer.Option(None, help="System message (implies --chat)."),
    dtype: str = typer.Option("auto", help="See `muxd serve --help`."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
    load_format: str = typer.Option("auto", help="auto/safetensors or dummy."),
) -> None:
    """Generate from one prompt and stream the text to the terminal."""
    from appliance.engine.request import SamplingParams

    cfg = ServeConfig(model=model, dtype=dtype, device=device, load_format=load_format, max_num_seqs=1)
    try:
        cfg.validate()
        engine = cfg.build_engine()
        text: str | list[int] = prompt
        if chat or system is not None:
            if engine.tokenizer is None:
                raise ApplianceError("--chat and --system need a tokenizer; this model directory has no "
                                     "tokenizer.json")
            messages = [{"role": "user", "content": prompt}]
            if system is not None:
                messages.insert(0, {"role": "system", "content": system})
            rendered = engine.tokenizer.apply_chat_template(messages)
            text = engine.tokenizer.encode(rendered, add_special_tokens=False)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                stop=list(stop or []))
        rid = engine.add_request(text, params)
    except ApplianceError as exc:
        _fail(exc)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                sys.stdout.write(out.new_text if engine.tokenizer else f"{out.new_token_ids[0]} ")
                sys.stdout.flush()
    sys.stdout.write("\n")



@app.command()
def version() -> None:
    """Print the muxd version."""
    typer.echo(f"muxd {__version__}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
