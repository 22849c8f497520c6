"""The options `muxd bench` and `muxd bench sweep` share (workload, target, SLO, output; vLLM's `bench serve` names
as aliases) and their parsing into one `BenchOptions`, refusing contradictory combinations before anything starts.
"""
from __future__ import annotations

import functools
import inspect
import re
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import click
import typer
from typer.core import TyperGroup

from appliance.bench.client import BACKENDS, ENDPOINTS
from appliance.bench.launcher import parse_cluster_args, parse_policies, parse_routers, parse_serve_args
from appliance.bench.run import BenchOptions
from appliance.errors import ApplianceError, ConfigError
from appliance.predictor.profile import read_profile
from appliance.slo.contract import load_contract
from appliance.workload import shaping as wl
from appliance.workload.metrics import METRIC_NAMES, SLO, parse_goodput
from appliance.workload.traces import FORMATS, detect_format

_W, _T, _S, _O = "Workload", "Target", "SLO", "Output"

# name -> (annotated type, default); shared by `muxd bench` and `muxd bench sweep`
COMMON: dict[str, tuple[Any, Any]] = {
    "trace": (Annotated[Optional[Path], typer.Option("--trace", "--dataset-path",
                                                     help="Trace file (Azure or BurstGPT CSV, Mooncake JSONL, "
                                                          "ShareGPT JSON); omit for a synthetic workload.",
                                                     rich_help_panel=_W)], None),
    "trace_format": (Annotated[str, typer.Option("--trace-format", "--dataset-name", help=f"auto, "
                                                 f"{', '.join(FORMATS)}; random: a synthetic workload.",
                                                 rich_help_panel=_W)], "auto"),
    "num_prompts": (Annotated[Optional[int], typer.Option(help="Number of requests: synthetic (default 1000), or "
                                                               "the trace's first N (as --max-requests).",
                                                          rich_help_panel=_W)], None),
    "workload": (Annotated[Optional[str], typer.Option(help="A named synthetic workload instead of a trace: "
                                                          "chat-short (prompts lognormal, median 1,000 tokens; outputs "
                                                          "lognormal, median 250; Poisson arrivals unless "
                                                          "--burstiness). Sets --input-len and --output-len.",
                                                     rich_help_panel=_W)], None),
    "input_len": (Annotated[str, typer.Option("--input-len", "--random-input-len",
                                              help="Synthetic prompt tokens: N, uniform:LO:HI or "
                                                   "lognormal:MEDIAN:SIGMA.", rich_help_panel=_W)], "1024"),
    "output_len": (Annotated[str, typer.Option("--output-len", "--random-output-len",
                                               help="Synthetic output tokens (same forms as --input-len).",
                                               rich_help_panel=_W)], "128"),
    "prefix_len": (Annotated[int, typer.Option(
        "--random-prefix-len", help="vLLM's: a prefix of this many tokens that every synthetic prompt starts with, "
                                    "before its own --input-len tokens.", rich_help_panel=_W)], 0),
    "sharegpt_output_len": (Annotated[Optional[int], typer.Option(
        help="vLLM's: every request of a ShareGPT file generates this many tokens instead of its recorded answer's.",
        rich_help_panel=_W)], None),
    "random_range_ratio": (Annotated[Optional[float], typer.Option(
        help="vLLM's: each fixed length N of --input-len and --output-len drawn uniformly from [N(1-R), N(1+R)] "
             "(0 <= R < 1).", rich_help_panel=_W)], None),
    "window": (Annotated[Optional[str], typer.Option(help="Part of the trace to replay, START:END seconds from its "
                                                          "start (e.g. 600:900).", rich_help_panel=_W)], None),
    "skip": (Annotated[int, typer.Option(help="Skip this many requests first.", rich_help_panel=_W)], 0),
    "max_requests": (Annotated[Optional[int], typer.Option(help="Replay at most this many requests.",
                                                           rich_help_panel=_W)], None),
    "request_rate": (Annotated[Optional[float], typer.Option(help="Re-time to this average rate (req/s), keeping "
                                                                 "the trace's burst pattern; 'inf' sends all at "
                                                                 "once. Default: the trace's own times (synthetic: "
                                                                 "inf).", rich_help_panel=_W)], None),
    "speedup": (Annotated[Optional[float], typer.Option(help="Replay the trace this many times faster.",
                                                        rich_help_panel=_W)], None),
    "burstiness": (Annotated[float, typer.Option(help="Gamma shape of synthetic gaps (1 = Poisson, < 1 burstier, "
                                                      "inf = constant).", rich_help_panel=_W)], 1.0),
    "seed": (Annotated[int, typer.Option(help="Seed of arrivals, lengths and prompts.", rich_help_panel=_W)], 0),
    "max_model_len": (Annotated[Optional[int], typer.Option(help="Clip requests to this context (default: what "
                                                                 "the server reports).", rich_help_panel=_W)], None),
    "url": (Annotated[Optional[str], typer.Option("--url", "--base-url",
                                                  help="Base URL of a running OpenAI-compatible server (e.g. "
                                                       "http://127.0.0.1:8000); default: start muxd serve.",
                                                  rich_help_panel=_T)], None),
    "endpoint": (Annotated[Optional[str], typer.Option(help="completions or chat (or their paths, "
                                                            "/v1/completions, /v1/chat/completions; default "
                                                            "completions).", rich_help_panel=_T)], None),
    "backend": (Annotated[Optional[str], typer.Option(help="vLLM's: vllm or openai (the completions endpoint), "
                                                           "openai-chat (chat).", rich_help_panel=_T)], None),
    "served_model_name": (Annotated[Optional[str], typer.Option(help="Model name to send (default: --model where "
                                                                     "the server lists it, else the first of GET "
                                                                     "/v1/models).", rich_help_panel=_T)], None),
    "model": (Annotated[Optional[str], typer.Option("--model", "-m", help="Model directory, Hugging Face id in the "
                                                                          "local cache, or 'embedded', to serve when "
                                                                          "muxd bench starts the server; with --url "
                                                                          "the model asked for (where the server "
                                                                          "lists it), as vLLM's. Also the tokenizer "
                                                                          "source.",
                                                    rich_help_panel=_T)], None),
    "tokenizer": (Annotated[Optional[str], typer.Option(help="Hugging Face directory (or id in the local cache) "
                                                             "whose tokenizer builds exact-length prompts (with "
                                                             "--url: default --model; needed unless the trace "
                                                             "records prompt texts).",
                                                        rich_help_panel=_T)], None),
    "policies": (Annotated[Optional[str], typer.Option(help="Comma-separated scheduling policies: start muxd serve "
                                                            "once per policy and compare them.",
                                                       rich_help_panel=_T)], None),
    "serve_args": (Annotated[Optional[str], typer.Option(help="Extra `muxd serve` flags for the server bench starts "
                                                              "or the in-process engine, e.g. '--max-num-seqs 64 "
                                                              "--load-format dummy'.", rich_help_panel=_T)], None),
    "routers": (Annotated[Optional[str], typer.Option(help="Comma-separated `muxd cluster` routers (slo, pow2): start "
                                                           "muxd cluster (engine replicas on Ray Serve; needs the "
                                                           "cluster extra) once per router and compare them.",
                                                      rich_help_panel=_T)], None),
    "cluster_args": (Annotated[Optional[str], typer.Option(help="Extra `muxd cluster` flags for the clusters "
                                                                "--routers starts, e.g. '--replicas 2 --replica-cpus "
                                                                "1' (engine flags go in --serve-args).",
                                                           rich_help_panel=_T)], None),
    "in_process": (Annotated[bool, typer.Option("--in-process", help="Drive the engine in this process (no HTTP).",
                                                rich_help_panel=_T)], False),
    "ready_timeout": (Annotated[float, typer.Option(help="Seconds to wait for a started server's /ready.",
                                                    rich_help_panel=_T)], 600.0),
    "temperature": (Annotated[float, typer.Option(help="Sampling temperature sent with every request.",
                                                  rich_help_panel=_T)], 0.0),
    "top_p": (Annotated[Optional[float], typer.Option(help="top_p sent with every request (vLLM's).",
                                                      rich_help_panel=_T)], None),
    "top_k": (Annotated[Optional[int], typer.Option(help="top_k sent with every request (vLLM's).",
                                                    rich_help_panel=_T)], None),
    "min_p": (Annotated[Optional[float], typer.Option(help="min_p sent with every request (vLLM's).",
                                                      rich_help_panel=_T)], None),
    "num_warmups": (Annotated[int, typer.Option(help="vLLM's: send this many of the workload's first requests, all "
                                                     "at once, before each replay (not counted).",
                                                rich_help_panel=_T)], 0),
    "max_concurrency": (Annotated[Optional[int], typer.Option(help="Requests in flight at most (latency then "
                                                                   "counts from the send).",
                                                              rich_help_panel=_T)], None),
    "request_timeout": (Annotated[Optional[float], typer.Option(help="Seconds after which a request counts as "
                                                                     "failed.", rich_help_panel=_T)], None),
    "max_idle": (Annotated[Optional[float], typer.Option(help="While no request is in flight, wait at most this "
                                                              "many seconds for the next arrival and move the rest "
                                                              "of the schedule earlier (latencies are unchanged, "
                                                              "times reported on the trace's clock): long replays "
                                                              "at low rates take their busy time only.",
                                                         rich_help_panel=_T)], None),
    "goodput": (Annotated[Optional[list[str]], typer.Option(help="vLLM-style SLO, a request is good when it meets "
                                                                 "every target: ttft:MS tpot:MS e2el:MS (after one "
                                                                 "flag as in vLLM, or repeat the flag).",
                                                            rich_help_panel=_S)], None),
    "slo": (Annotated[Optional[Path], typer.Option(help="YAML SLO contract (per-request targets).",
                                                   rich_help_panel=_S)], None),
    "metric_percentiles": (Annotated[str, typer.Option(help="Percentiles to report, comma-separated.",
                                                       rich_help_panel=_S)], "50,90,99"),
    "percentile_metrics": (Annotated[str, typer.Option(help="Metrics whose percentiles are reported, "
                                                             "comma-separated among ttft, tpot, itl, e2el.",
                                                        rich_help_panel=_S)], ",".join(METRIC_NAMES)),
    "result_dir": (Annotated[Optional[Path], typer.Option(help="Write result JSON, plots (and sweep summary.csv) "
                                                               "here.", rich_help_panel=_O)], None),
    "save_result": (Annotated[bool, typer.Option("--save-result", help="Write the result JSON (to --result-dir, "
                                                                       "else the current directory).",
                                                 rich_help_panel=_O)], False),
    "result_filename": (Annotated[Optional[str], typer.Option(help="File name of the result JSON of a single run "
                                                                   "(default: result.json).", rich_help_panel=_O)],
                        None),
    "append_result": (Annotated[bool, typer.Option("--append-result", help="vLLM's: add the result JSON to the file "
                                                                           "as one more line instead of replacing "
                                                                           "it.", rich_help_panel=_O)], False),
    "label": (Annotated[Optional[str], typer.Option(help="vLLM's: the results' label (before the policy's, with "
                                                         "--policies).", rich_help_panel=_O)], None),
    "metadata": (Annotated[Optional[list[str]], typer.Option(help="vLLM's: KEY=VALUE pairs written into the result "
                                                                  "JSON (after one flag as in vLLM, or repeat the "
                                                                  "flag).", rich_help_panel=_O)], None),
    "save_detailed": (Annotated[bool, typer.Option("--save-detailed", help="Add per-request arrays to the JSON "
                                                                           "(ttfts, itls, input/output lens).",
                                                   rich_help_panel=_O)], False),
    "save_steps": (Annotated[bool, typer.Option("--save-steps", help="--in-process: add every engine step and "
                                                                     "prefill launch of the replay to the JSON "
                                                                     "(`steps`, `prefills`; `muxd bench diagnose "
                                                                     "--from-steps/--from-prefills` reads them), "
                                                                     "with the engine thread's stack sampled in "
                                                                     "launches over 25 ms. The logging takes host "
                                                                     "time from the engine. --simulate: the "
                                                                     "simulated steps and launches, in virtual "
                                                                     "time (each sweep point's JSON, else "
                                                                     "steps-POLICY.json).",
                                                rich_help_panel=_O)], False),
    "spread_ties": (Annotated[bool, typer.Option("--spread-ties", help="Spread requests that share a timestamp "
                                                                       "(traces recorded in coarse steps, e.g. "
                                                                       "Mooncake's 3 s) over the gap to the next.",
                                                 rich_help_panel=_W)], False),
    "simulate": (Annotated[bool, typer.Option("--simulate", help="No server and no GPU: replay each --policies "
                                                                 "entry on the simulated executor, judge it against "
                                                                 "--slo and search its capacity.",
                                              rich_help_panel=_T)], False),
    "profile": (Annotated[Optional[Path], typer.Option(help="--simulate: latency profile of --model on --gpu "
                                                            "(default: as `muxd serve` finds one: cached by `muxd "
                                                            "profile`, or shipped; else the roofline prior).",
                                                       rich_help_panel=_T)], None),
    "gpu": (Annotated[Optional[str], typer.Option(help="--simulate: the GPU to plan for (h100, h200; default: the "
                                                       "one --profile was measured on, else h100).",
                                                  rich_help_panel=_T)], None),
    "device_error": (Annotated[float, typer.Option(help="--simulate: model error injected, the simulated GPU runs "
                                                        "(1 + this) x the profile's times (0.2: 20 % slower, -0.2: "
                                                        "20 % faster); the planner is not told.",
                                                   rich_help_panel=_T)], 0.0),
    "device_spread": (Annotated[float, typer.Option(help="--simulate: judge each rate over three replays, the "
                                                         "simulated GPU as profiled, this much slower and this much "
                                                         "faster, pooled as slices of one replay are: a capacity "
                                                         "that holds across that much difference in device speed "
                                                         "(two H200 hosts differed by about 5 %); 0 judges one "
                                                         "replay.", rich_help_panel=_T)], 0.05),
    "host_error": (Annotated[float, typer.Option(help="--simulate: host error injected, the simulated host takes "
                                                      "(1 + this) x the host model's times (step, launches); the "
                                                      "planner is not told.", rich_help_panel=_T)], 0.0),
    "host_spread": (Annotated[float, typer.Option(help="--simulate: each prefill launch's host time is a lognormal "
                                                       "multiple (median 1, this sigma) of the host model's, as on a "
                                                       "serving host (the default: the spread measured around the "
                                                       "fitted launch times on an H200, 0.17-0.22; a busy H100 host "
                                                       "showed 0.46); the planner is not told; 0: the model's time.",
                                                  rich_help_panel=_T)], 0.2),
    "planner_prior": (Annotated[bool, typer.Option("--planner-prior", help="--simulate: the planner starts from "
                                                                           "the roofline prior, as `muxd serve` "
                                                                           "does where no profile exists for the "
                                                                           "model and GPU, while the simulated GPU "
                                                                           "and host run the profile: what mux "
                                                                           "keeps before `muxd profile`.",
                                                   rich_help_panel=_T)], False),
    "progress": (Annotated[bool, typer.Option("--progress/--no-progress", " /--disable-tqdm",
                                              help="Show a progress bar.", rich_help_panel=_O)], True),
    "ignore_eos": (Annotated[bool, typer.Option("--ignore-eos", help="Accepted as vLLM's: outputs are always forced "
                                                                     "to the recorded length (ignore_eos).",
                                                rich_help_panel=_T)], False),
    "trust_remote_code": (Annotated[bool, typer.Option("--trust-remote-code", help="Accepted as vLLM's: muxd runs "
                                                                                   "no code from a model directory.",
                                                       rich_help_panel=_T)], False),
}


_LISTS = {"--goodput": re.compile(r"\w+:[-+.\w]*"),  # vLLM's flags taking several values after one flag
          "--metadata": re.compile(r"[^-=\s][^=\s]*=\S*")}


def fold_lists(args: list[str]) -> list[str]:
    """vLLM's `--goodput ttft:MS tpot:MS` and `--metadata K=V K2=V2` (several values after one flag) as one flag per
    value."""
    out: list[str] = []
    flag, take = "", 0  # take 2: the next word is the flag's value; 1: later words of its form are more values
    for arg in args:
        if take == 1 and _LISTS[flag].fullmatch(arg):
            out += [flag, arg]
            continue
        name = arg.split("=", 1)[0]
        if arg in _LISTS:
            flag, take = arg, 2
        elif take == 2:
            take = 1
        elif name in _LISTS:  # --flag=VALUE
            flag, take = name, 1
        else:
            take = 0
        out.append(arg)
    return out


class BenchGroup(TyperGroup):
    """The `muxd bench` group: takes vLLM's `--goodput` and `--metadata` forms before typer parses (for `sweep`
    too)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, fold_lists(args))


def _profiled_gpu(profile: Path | None) -> str | None:
    """The GPU a --profile was measured on (None without one, or for a file that is not a profile: the simulation
    then says why it cannot use it)."""
    if profile is None:
        return None
    try:
        return read_profile(profile).gpu.name
    except ConfigError:
        return None


def with_common_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Give a command the COMMON options (typer reads the signature); they reach it as one BenchOptions `opts`."""
    sig = inspect.signature(func)
    own = [p for name, p in sig.parameters.items() if name != "opts"]
    shared = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
              for name, (annotation, default) in COMMON.items()]
    ctx = [p for p in own if p.annotation is typer.Context]
    rest = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own if p.annotation is not typer.Context]

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        common = {name: kwargs.pop(name) for name in COMMON}
        try:
            opts = _options(**common)
            return func(*args, opts=opts, **kwargs)
        except ApplianceError as exc:
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=2) from None

    del wrapper.__wrapped__
    wrapper.__signature__ = sig.replace(parameters=ctx + rest + shared)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in ctx + rest + shared}
    return wrapper


def _options(**kw: Any) -> BenchOptions:
    """Flags -> BenchOptions, refusing contradictory combinations before anything starts."""
    if kw["simulate"] and (kw["url"] or kw["in_process"]):
        raise ConfigError("--simulate replays on the simulated executor; --url and --in-process run a real one")
    if kw["url"] and (kw["policies"] or kw["in_process"]):
        raise ConfigError("--url targets a running server; --policies and --in-process start their own")
    if kw["routers"] and (kw["url"] or kw["in_process"] or kw["simulate"]):
        raise ConfigError("--routers starts a muxd cluster per router; --url, --in-process and --simulate do not")
    if kw["cluster_args"] and not kw["routers"]:
        raise ConfigError("--cluster-args configures the muxd cluster that --routers starts; give --routers")
    if kw["serve_args"] and kw["url"]:
        raise ConfigError("--serve-args configures the muxd serve that bench starts (or --in-process), not --url")
    given, backend = kw["endpoint"], kw.pop("backend")
    endpoint = {path: name for name, path in ENDPOINTS.items()}.get(given, given)
    if backend is not None:
        if backend not in BACKENDS:
            raise ConfigError(f"--backend {backend!r} is not served by muxd bench; give one of "
                              f"{', '.join(BACKENDS)} (any OpenAI-compatible server)")
        if endpoint is not None and endpoint != BACKENDS[backend]:
            raise ConfigError(f"--backend {backend} sends to the {BACKENDS[backend]} endpoint; --endpoint {given} "
                              "names the other one")
        endpoint = BACKENDS[backend]
    kw["endpoint"] = endpoint or "completions"
    if kw["endpoint"] not in ENDPOINTS:
        raise ConfigError(f"--endpoint must be completions or chat (vLLM's {' or '.join(ENDPOINTS.values())}), "
                          f"got {kw['endpoint']!r}")
    if kw["trace_format"] == "random":  # vLLM's --dataset-name random: a synthetic workload
        if kw["trace"] is not None:
            raise ConfigError("--dataset-name random is a synthetic workload; leave out --trace/--dataset-path")
        kw["trace_format"] = "auto"
    if kw["trace_format"] not in ("auto", *FORMATS):
        raise ConfigError(f"--trace-format (--dataset-name) must be one of auto, random, {', '.join(FORMATS)}, "
                          f"got {kw['trace_format']!r}")
    if kw["trace_format"] != "auto" and kw["trace"] is None:
        raise ConfigError(f"--dataset-name {kw['trace_format']} reads a trace file: give --dataset-path (--trace)")
    if kw["num_prompts"] is None:
        kw["num_prompts"] = 1000
    elif kw["num_prompts"] < 1:
        raise ConfigError(f"--num-prompts must be >= 1, got {kw['num_prompts']}")
    elif kw["trace"] is not None:  # vLLM's --num-prompts with a dataset: that many of its requests
        if kw["max_requests"] is not None:
            raise ConfigError("--num-prompts and --max-requests both limit the trace's requests; give one")
        kw["max_requests"] = kw["num_prompts"]
    if kw.pop("save_result") and kw["result_dir"] is None:
        kw["result_dir"] = Path(".")
    if kw["result_filename"] is not None and not kw["result_filename"].strip():
        raise ConfigError("--result-filename is empty; give a file name")
    pairs = [item.split("=", 1) for item in kw.pop("metadata") or []]
    bad = [k for k, *v in pairs if not v or not k.strip()]
    if bad:
        raise ConfigError(f"--metadata takes KEY=VALUE pairs, got {bad[0]!r}")
    kw["metadata"] = {k.strip(): v.strip() for k, v in pairs}
    if kw["append_result"] and kw["result_dir"] is None:
        raise ConfigError("--append-result adds to a result file: give --save-result or --result-dir")
    kw["percentile_metrics"] = _metric_names(kw["percentile_metrics"])
    if kw["num_warmups"] < 0:
        raise ConfigError(f"--num-warmups must be >= 0, got {kw['num_warmups']}")
    if kw["max_concurrency"] is not None and kw["max_concurrency"] < 1:
        raise ConfigError(f"--max-concurrency must be >= 1, got {kw['max_concurrency']}")
    if kw["request_timeout"] is not None and not kw["request_timeout"] > 0:
        raise ConfigError(f"--request-timeout must be > 0 seconds, got {kw['request_timeout']:g}")
    if kw["skip"] < 0:
        raise ConfigError(f"--skip must be >= 0, got {kw['skip']}")
    if kw["result_dir"] is not None and kw["result_dir"].exists() and not kw["result_dir"].is_dir():
        raise ConfigError(f"--result-dir {kw['result_dir']} is a file; give a directory")
    if kw["gpu"] is None:
        kw["gpu"] = _profiled_gpu(kw["profile"]) or "h100"
    if kw["max_idle"] is not None and kw["max_idle"] < 0:
        raise ConfigError(f"--max-idle must be >= 0 seconds, got {kw['max_idle']:g}")
    if kw["planner_prior"] and not kw["simulate"]:
        raise ConfigError("--planner-prior plans a simulated replay from the roofline prior: give --simulate")
    if kw["save_steps"] and not (kw["in_process"] or kw["simulate"]):
        raise ConfigError("--save-steps logs the engine's steps in this process: give --in-process (or --simulate)")
    if kw["in_process"] and kw["endpoint"] == "chat":
        raise ConfigError("--in-process sends prompts straight to the engine; --endpoint chat needs a server")
    preset = kw.pop("workload")
    if preset is not None:
        if kw["trace"] is not None:
            raise ConfigError("--workload names a synthetic workload; give it or --trace, not both")
        kw["input_len"], kw["output_len"] = wl.preset(preset)
    if kw["prefix_len"] < 0:
        raise ConfigError(f"--random-prefix-len must be >= 0, got {kw['prefix_len']}")
    if kw["prefix_len"] and kw["trace"] is not None:
        raise ConfigError("--random-prefix-len gives a synthetic workload a shared prefix; a trace has its own prompts")
    if kw["sharegpt_output_len"] is not None:
        if kw["sharegpt_output_len"] < 1:
            raise ConfigError(f"--sharegpt-output-len must be >= 1, got {kw['sharegpt_output_len']}")
        fmt = kw["trace_format"]
        if fmt == "auto" and kw["trace"] is not None and kw["trace"].is_file():
            fmt = detect_format(kw["trace"])
        if kw["trace"] is None or fmt not in ("auto", "sharegpt"):
            raise ConfigError("--sharegpt-output-len sets the output lengths of a ShareGPT file (--dataset-path); "
                              f"this workload is {'synthetic' if kw['trace'] is None else fmt}")
    sampling = {k: kw.pop(k) for k in ("top_p", "top_k", "min_p")}
    kw["sampling"] = {k: v for k, v in sampling.items() if v is not None}
    ratio = kw.pop("random_range_ratio")
    if ratio is not None:
        if kw["trace"] is not None:
            raise ConfigError("--random-range-ratio spreads the lengths of a synthetic workload; a trace has its own")
        kw["input_len"] = wl.LengthDist.parse(kw["input_len"], "--input-len").spread(ratio, "--random-range-ratio")
        kw["output_len"] = wl.LengthDist.parse(kw["output_len"], "--output-len").spread(ratio, "--random-range-ratio")
    slo = _slo(kw.pop("goodput") or [], kw.pop("slo"))
    percentiles = _percentiles(kw.pop("metric_percentiles"))
    policies = parse_policies(kw.pop("policies")) if kw["policies"] else []
    serve_args = parse_serve_args(kw.pop("serve_args"))
    routers_text = kw.pop("routers")
    routers = parse_routers(routers_text) if routers_text is not None else []
    cluster_args = parse_cluster_args(kw.pop("cluster_args"))
    window = wl.parse_window(kw.pop("window")) if kw["window"] else None
    for accepted in ("progress", "ignore_eos", "trust_remote_code"):  # read by the command, or changing nothing
        kw.pop(accepted)
    return BenchOptions(**{k: v for k, v in kw.items() if k not in ("policies", "serve_args", "window")},
                        window=window, slo=slo, percentiles=percentiles, policies=policies, serve_args=serve_args,
                        routers=routers, cluster_args=cluster_args)


def _slo(goodput: list[str], contract: Optional[Path]) -> SLO | None:
    if goodput and contract:
        raise ConfigError("give either --goodput or --slo, not both")
    if contract is None:
        return parse_goodput(goodput)
    if not contract.is_file():
        raise ConfigError(f"--slo {contract}: file not found")

    return load_contract(contract)  # a Contract gives per-request targets (targets_for) and a verdict on the run


def _metric_names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in METRIC_NAMES]
    if unknown or not names:
        raise ConfigError(f"--percentile-metrics: {', '.join(unknown) or 'nothing given'}; choose among "
                          f"{', '.join(METRIC_NAMES)}")
    return names


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        values = ()
    if not values or any(not 0 < p < 100 for p in values):
        raise ConfigError(f"--metric-percentiles: expected numbers in (0, 100) like 50,90,99, got {text!r}")
    return values


# ---- shared steps -------------------------------------------------------------------------------------------------
