"""`muxd profile`: the command around profile/profiler.py — flags, the grid's ranges (defaults or a trace's), the
engine it measures, a progress bar, and the summary it prints (samples, held-out errors, what the budget left out)."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from appliance.config import Config
from appliance.engine.compile import cache_dir
from appliance.engine.factory import build_engine
from appliance.errors import ApplianceError, ConfigError
from appliance.model_zoo.config import ModelConfig
from appliance.predictor.catalog import cache_profile, profile_key
from appliance.predictor.host import fit_host
from appliance.predictor.profile import save_profile
from appliance.profile.calibrate import calibrate_serving, calibration_seconds
from appliance.profile.grid import Ranges, plan_points, reused_tokens
from appliance.profile.profiler import NOISY_SPREAD, refit_profile, run_profile
from appliance.profile.timer import StepTimer
from appliance.workload import shaping as wl
from appliance.workload.traces import load_trace


def trace_ranges(path: str, fmt: str) -> Ranges:
    specs = load_trace(path, fmt)
    if not specs:
        raise ConfigError(f"--trace {path}: no requests in it")
    return Ranges.from_lengths([s.prompt_len for s in specs], [s.output_len for s in specs], reused_tokens(specs))


def _calibration(traces: List[str], rates: List[float], requests: List[int]) -> list[tuple[str, float, int]]:
    """(trace, rate, requests) of each calibration replay: --calibrate-rate and --calibrate-requests given once
    apply to every --calibrate-trace, else once per trace, in order."""
    if not traces:
        raise ConfigError("--calibrate-rate replays --calibrate-trace or --trace: pass one")
    for name, values in (("--calibrate-rate", rates), ("--calibrate-requests", requests)):
        if len(values) not in (1, len(traces)):
            raise ConfigError(f"{name} is given {len(values)} times for {len(traces)} calibration traces: give it "
                              "once, or once per --calibrate-trace")
    for path in traces:
        if path not in wl.PRESETS and not Path(path).is_file():  # found out now, not after the grid
            raise ConfigError(f"--calibrate-trace {path}: no such file (nor a named workload: "
                              f"{', '.join(wl.PRESETS)})")
    runs = [(path, rates[i % len(rates)], requests[i % len(requests)]) for i, path in enumerate(traces)]
    bad = [(rate, n) for _, rate, n in runs if rate <= 0 or n < 1]
    if bad:
        raise ConfigError(f"--calibrate-rate must be > 0 and --calibrate-requests >= 1, got {bad[0][0]:g} and "
                          f"{bad[0][1]}")
    return runs


def calibration_requests(path: str, n: int, trace_format: str = "auto") -> list:
    """The requests of one calibration replay: a trace's first n, or n of a named synthetic workload (`chat-short`:
    Poisson arrivals, re-timed to the replay's rate)."""
    if path in wl.PRESETS:
        prompt, output = wl.preset(path)
        return wl.synthetic(n, 1.0, wl.LengthDist.parse(prompt, "--calibrate-trace"),
                            wl.LengthDist.parse(output, "--calibrate-trace"))
    return wl.select(load_trace(path, trace_format), max_requests=n)


def profile_command(app: typer.Typer) -> None:
    @app.command()
    def profile(
        model: str = typer.Option("embedded", "--model", "-m", help="Model directory (or 'embedded')."),
        out: Optional[Path] = typer.Option(None, "--out", "-o", help="Profile file to write (JSON; default: the cache "
                                           "`muxd serve` looks in, for this model and GPU); samples are logged "
                                 "beside it as OUT.samples.jsonl."),
        load_format: str = typer.Option("auto", help="auto/safetensors, or dummy (random weights: step times "
                                        "do not depend on the values)."),
        dtype: str = typer.Option("auto", help="See `muxd serve --help`."),
        device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
        budget_minutes: float = typer.Option(15.0, help="Wall-clock budget of the whole run, start-up included; "
                                             "points that would not fit are left out (--resume adds them later)."),
        resume: bool = typer.Option(False, "--resume", help="Keep the samples an earlier run logged beside --out "
                                    "and measure only the missing points."),
        trace: Optional[str] = typer.Option(None, help="Trace whose prompt, reuse and context lengths choose the "
                                            "grid's ranges (default: a generic grid)."),
        trace_format: str = typer.Option("auto", help="auto, azure, mooncake, burstgpt, sharegpt."),
        max_num_seqs: int = typer.Option(256, help="Largest decode batch profiled (the server's --max-num-seqs)."),
        max_num_batched_tokens: int = typer.Option(8192, help="Largest prefill profiled (the server's "
                                                   "--max-num-batched-tokens)."),
        max_model_len: int = typer.Option(32768, help="Longest context profiled."),
        partition_granularity: int = typer.Option(16, help="Decode partitions are multiples of this many SMs "
                                                  "(the server's --partition-granularity)."),
        prefill_graph_rows: Optional[int] = typer.Option(None, help="Prefill launches of up to this many tokens "
                                                         "replay piecewise CUDA graphs (the server's "
                                                         "--prefill-graph-rows; default: the server's for this "
                                                         "model)."),
        tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", "-tp", help="GPUs the model is split "
                                                 "across (the server's --tensor-parallel-size); every step is timed "
                                                 "on rank 0, collectives included, and the profile serves only this "
                                                 "size."),
        holdout: int = typer.Option(4, help="Held-out random points per partition and phase (never fitted; they "
                                    "measure the predictor's error)."),
        seed: int = typer.Option(0, help="Seed of the held-out points' draw (another seed, other points)."),
        calibrate_rate: Optional[List[float]] = typer.Option(None, help="After the grid, replay a trace at this "
                                                             "many requests/s in process (chunked prefill, then mux "
                                                             "on a GPU) and keep how much slower steps ran while "
                                                             "serving than profiled; `muxd bench --simulate` applies "
                                                             "it (the replays' time comes out of the budget). Once "
                                                             "per --calibrate-trace, or once for all."),
        calibrate_requests: Optional[List[int]] = typer.Option(None, help="Requests in the calibration replay (the "
                                                               "trace's first; default 200). Once per "
                                                               "--calibrate-trace, or once for all."),
        calibrate_trace: Optional[List[str]] = typer.Option(None, help="Trace the calibration replays (default: "
                                                            "--trace), or a named synthetic workload (chat-short). "
                                                            "Repeat it to calibrate on several workloads "
                                                            "(short and long prompts: the split's slowdown is "
                                                            "fitted over the spans they reach)."),
        progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
        refit: Optional[Path] = typer.Option(None, help="Measure nothing: fit --out again from this samples log "
                                             "(OUT.samples.jsonl of an earlier run, after the model's form "
                                             "changed), keeping the serving block of the profile beside it."),
    ) -> None:
        """Profile this model on this GPU: solo prefill and decode on every SM partition, decode beside a prefill
        and mixed (chunked-prefill) steps, within a time budget; write the profile `muxd serve --policy mux
        --profile` loads. Run it on an otherwise idle machine: short steps take their time from the host."""
        started = time.perf_counter()
        console = Console(stderr=True)
        try:
            if budget_minutes <= 0:
                raise ConfigError(f"--budget-minutes must be > 0, got {budget_minutes}")
            if holdout < 0:
                raise ConfigError(f"--holdout must be >= 0, got {holdout}")
            if out is not None and (out.suffix == ".jsonl" or out.is_dir()):
                raise ConfigError(f"--out {out}: give the profile file's path (e.g. llama-8b-h200.json)")
            if out is not None and not out.parent.is_dir():
                raise ConfigError(f"--out {out}: directory {out.parent} does not exist")
            if refit is not None:
                if out is None:
                    raise ConfigError("--refit writes the profile to --out: pass one")
                config = ModelConfig.from_file(Config.flat(model=model).model.model_dir / "config.json")
                result = refit_profile(refit, out, config, max_graph_batch=min(max_num_seqs, 256))
                _report(result, budget_minutes=None)
                return
            calibration = _calibration(calibrate_trace or ([trace] if trace else []), calibrate_rate or [],
                                       calibrate_requests or [200]) if calibrate_rate else []
            if (calibrate_trace or calibrate_requests) and not calibrate_rate:
                raise ConfigError("--calibrate-trace and --calibrate-requests shape the calibration replay: pass "
                                  "--calibrate-rate too")
            reserve = calibration_seconds([(n, rate) for _, rate, n in calibration]) if calibration else 0.0
            if reserve >= budget_minutes * 60:
                raise ConfigError(f"the calibration replays (about {reserve / 60:.1f} minutes) leave nothing of "
                                  f"--budget-minutes {budget_minutes:g} for the grid")
            ranges = (trace_ranges(trace, trace_format) if trace else Ranges()).clipped(
                max_num_batched_tokens, max_num_seqs, max_model_len)
            cfg = Config.flat(model=model, dtype=dtype, device=device, load_format=load_format,
                              max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                              max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False,
                              partition_granularity=partition_granularity, prefill_graph_rows=prefill_graph_rows,
                              tensor_parallel_size=tensor_parallel_size)
            cfg = cfg.replace(multiplex=True if cfg.runtime.resolved_device().startswith("cuda") else None)
            model_config = cfg.check()
            logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
            console.print(f"muxd profile: loading {cfg.model.model_name} ...")
            engine = build_engine(cfg)
            timer = StepTimer(engine)
            if out is None:
                out = cache_dir() / "profiles" / profile_key(model_config, timer.gpu_name)
                out.parent.mkdir(parents=True, exist_ok=True)
            kv_tokens = engine.pool.num_pages * engine.pool.page_size
            points = plan_points(ranges, timer.sm_count, timer.decode_partitions, holdout, seed, kv_tokens=kv_tokens)
            too_big = len(plan_points(ranges, timer.sm_count, timer.decode_partitions, holdout, seed)) - len(points)
            console.print(f"{timer.gpu_name}: {timer.sm_count} SMs, decode partitions "
                          f"{timer.decode_partitions or 'none'}; {len(points)} points to measure ({too_big} larger "
                          "than the KV pool left out)")
            with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=console, disable=not progress) as bar:
                task = bar.add_task("profiling", total=len(points))

                def on_point(point, ms) -> None:
                    bar.update(task, advance=1, description=f"{point.kind} {point.sms} SMs")

                result = run_profile(timer, points, out, model_name=cfg.model.model_name,
                                     budget_s=budget_minutes * 60 - reserve, started=started, resume=resume,
                                     kv_tokens=kv_tokens, on_point=on_point)
            if calibration:
                workloads = []
                for path, rate, n in calibration:
                    console.print(f"calibrating: {n} requests of {path} at {rate:g}/s ...")
                    workloads.append((calibration_requests(path, n, trace_format if path == trace else "auto"),
                                      rate))
                predictor = result.profile.predictor(engine.model.config.num_layers, "profile")
                factors, steps, prefills = calibrate_serving(engine, workloads, predictor)
                logs = [out.with_name(f"{out.name}.calibration-{kind}.json") for kind in ("steps", "prefills")]
                for path, rows in zip(logs, (steps, prefills)):
                    path.write_text(json.dumps(rows))
                result.profile.serving = factors
                host = fit_host(steps)
                if host is not None:
                    result.profile.host = host.as_dict()
                    console.print(f"host time per step: {host.step_ms:.2f} ms + {host.per_row_us:.1f} us per decode "
                                  f"row; per prefill launch {host.launch_ms:.2f} ms + {host.per_layer_ms:.3f} ms per "
                                  f"layer eagerly, {host.graph_launch_ms:.2f} ms + {host.graph_per_layer_ms:.3f} ms "
                                  "per layer replaying graphs")
                save_profile(result.profile, result.path)
                result.elapsed_s = time.perf_counter() - started  # the whole run, the replay included
                console.print("serving factors (serving time / profiled time): "
                              + (", ".join(f"{k} {v:.3f}" for k, v in factors.items()) or "too few steps"))
                console.print(f"the calibration's logs: {logs[0]}, {logs[1]} (`muxd bench diagnose --profile "
                              "PROFILE --from-steps STEPS --from-prefills PREFILLS` fits them again)")
        except ApplianceError as exc:
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=2)
        result.skipped_memory += too_big
        _report(result, budget_minutes)
        cached = cache_profile(result.path, model_config, timer.gpu_name, cache_dir())
        typer.echo(f"cached as {cached}: `muxd serve` finds it for this model on this GPU")
        if result.spread:
            typer.echo(f"repeated points: their runs differ by {result.spread_median:.1%} at the median, "
                       f"{result.spread_p90:.1%} at the 90th percentile")
            if result.noisy:
                typer.secho(f"warning: one repeated point in ten or more differs by over {NOISY_SPREAD:.0%} "
                            "between its runs: something else kept this host busy (another process, another GPU's "
                            "work); the medians absorb some of it, but a profile taken on an idle machine fits "
                            "tighter", fg=typer.colors.YELLOW, err=True)
        else:
            typer.echo("repeated points: none (no short point to repeat, or the budget left no time to)")


def _report(result, budget_minutes: float | None) -> None:
    """The held-out error table and what the run did (a refit: what it read)."""
    table = Table(title=f"held-out error of the fitted predictor ({result.path})")
    for col in ("phase", "samples", "mean error", "max error", "worst point: measured / predicted"):
        table.add_column(col, justify="left" if col in ("phase", "worst point: measured / predicted") else "right")
    for kind in ("prefill", "decode", "contended", "mixed"):
        if f"{kind}_n" in result.errors:
            table.add_row(kind, f"{result.errors[kind + '_n']:.0f}", f"{result.errors[kind + '_mean']:.1%}",
                          f"{result.errors[kind + '_max']:.1%}", _describe(*result.worst[kind]) if kind in
                          result.worst else "")
    Console(width=160).print(table)
    if budget_minutes is None:
        typer.echo(f"wrote {result.path}: fitted again from the {result.resumed} samples of {result.samples_path}")
        return
    typer.echo(f"wrote {result.path}: {result.measured} samples measured, {result.resumed} resumed, "
               f"{result.skipped_budget} left out by the budget, {result.skipped_memory} larger than the KV pool, "
               f"{result.failed} not measurable, {result.revisited} repeated host-bound measurements; "
               f"{result.elapsed_s / 60:.1f} of {budget_minutes:g} minutes")


def _describe(point, measured: float, predicted: float) -> str:
    """A held-out point in words: what ran where, measured and predicted milliseconds."""
    prompt = f"{point.new} new + {point.reused} cached tokens"
    batch = f"batch {point.batch} x {point.context} tokens"
    what = {"prefill": f"{point.sms} SMs, {prompt}", "decode": f"{point.sms} SMs, {batch}",
            "contended": f"decode on {point.sms} SMs, {batch}, beside a prefill of {prompt}",
            "mixed": f"all SMs, {prompt} with {batch}"}[point.kind]
    return f"{what}: {measured:.1f} / {predicted:.1f} ms"
