"""The `muxd bench engine` command (registered on the `bench` command group)."""
from __future__ import annotations

from typing import Optional

import typer

from appliance.bench import engine_bench, multiplex_bench
from appliance.config import Config


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise typer.BadParameter(f"{flag} takes positive integers, got {text!r}")
    return values


def _prefills(text: str) -> list[tuple[int, int]]:
    """'512,2048,2048@8192' -> [(512, 0), (2048, 0), (2048, 8192)] (new tokens @ cached tokens)."""
    out = []
    for item in text.split(","):
        new, _, cached = item.strip().partition("@")
        try:
            out.append((int(new), int(cached or 0)))
        except ValueError:
            raise typer.BadParameter(f"--prefill items are NEW or NEW@CACHED token counts, got {item!r}") from None
    return out


def _kernel_rows(text: str) -> list[tuple[int, int]]:
    """'1@1024,64@8192' -> [(1, 1024), (64, 8192)] (decode batch @ context)."""
    out = []
    for item in (i.strip() for i in text.split(",") if i.strip()):
        batch, _, context = item.partition("@")
        try:
            out.append((int(batch), int(context)))
        except ValueError:
            raise typer.BadParameter(f"--kernels items are BATCH@CONTEXT, got {item!r}") from None
        if min(out[-1]) < 1:
            raise typer.BadParameter(f"--kernels takes positive batch sizes and contexts, got {item!r}")
    return out


def engine_bench_command(bench_app: typer.Typer) -> None:
    @bench_app.command("engine")
    def engine(
        model: str = typer.Option("configs/models/llama-3.1-8b", "--model", "-m", help="Model directory."),
        load_format: str = typer.Option("dummy", help="dummy (random weights of the real shapes) or auto."),
        dtype: Optional[str] = typer.Option(None, help="Weights dtype (default: the checkpoint's)."),
        batches: str = typer.Option("1,8,32,64,128", help="Decode batch sizes."),
        contexts: str = typer.Option("1024,8192", help="Decode context lengths."),
        prefill: str = typer.Option("512,2048,8192,2048@8192,2048@32768",
                                    help="Prefill rows: NEW or NEW@CACHED tokens."),
        iters: int = typer.Option(20, help="Timed decode steps per row."),
        attention_backend: str = typer.Option("auto", help="auto, flashinfer or torch."),
        decode_kernel: str = typer.Option("auto", help="Attention kernel of graph decode steps: auto (muxd's Triton "
                                          "kernels where they take the model's shape, else flashinfer's), "
                                          "flashinfer, or triton (muxd's, else an error)."),
        decode_blas: str = typer.Option("cublaslt", help="BLAS library of the decode graphs: cublaslt or cublas."),
        fused_rope: bool = typer.Option(True, "--fused-rope/--no-fused-rope", help="One kernel rotates q and k and "
                                        "writes K/V (flashinfer backend); off: the compiled layers rotate."),
        pdl: bool = typer.Option(True, "--pdl/--no-pdl", help="Programmatic dependent launch of one-row steps' "
                                 "kernels (Hopper and later)."),
        compile: bool = typer.Option(True, "--compile/--no-compile", help="torch.compile each layer."),
        cuda_graph: bool = typer.Option(True, "--cuda-graph/--no-cuda-graph", help="Decode CUDA graphs."),
        prefill_graph_rows: Optional[int] = typer.Option(None, "--prefill-graph-rows", help="Prefill launches of up "
                                                         "to this many tokens replay piecewise CUDA graphs (as serve's "
                                                         "flag, default 2048; 0: none): fewer rows start faster."),
        async_scheduling: bool = typer.Option(True, "--async-scheduling/--no-async-scheduling",
                                              help="The engine's overlapped loop (plan the next step while one runs), "
                                                   "as `muxd serve` runs it by default."),
        compare_sync: bool = typer.Option(False, "--compare-sync", help="Also time every decode row with the "
                                          "synchronous loop (rows marked 'sync loop'): host ms on and off."),
        startup_only: bool = typer.Option(False, "--startup-only", help="Only build the engine and report "
                                                                       "start-up times (run twice: cold, warm)."),
        multiplex: bool = typer.Option(False, "--multiplex", help="Instead of the rows above: decode on each SM "
                                       "partition alone and beside an 8k prefill, graph memory, switch cost."),
        granularity: int = typer.Option(16, help="--multiplex: decode partitions are multiples of this many SMs."),
        tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", "-tp", help="GPUs the model is split "
                                                 "across (one process each); the rows are timed on rank 0."),
        kernels: str = typer.Option("", "--kernels", help="Decode steps whose kernels the profiler breaks down "
                                    "by name (launches and device ms a step, against the graph replay's time) and by "
                                    "role (projections, attention, LM head, against the bytes each reads): "
                                    "BATCH@CONTEXT items, e.g. 1@1024,64@1024."),
        log_level: str = typer.Option("warning", "--log-level", help="Logging on stderr while the engine starts "
                                      "and runs (info: its start-up stages, on every rank): debug, info, warning, "
                                      "error."),
        json_out: Optional[str] = typer.Option(None, "--json", help="Write the result as JSON here."),
        markdown_out: Optional[str] = typer.Option(None, "--markdown", help="Write the Markdown table here."),
    ) -> None:
        """Time the engine on one GPU: decode steps by batch and context, prefills by new and cached tokens, each
        with its floor from ceilings measured in the same run."""
        import logging

        import torch

        if log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            typer.secho(f"error: --log-level {log_level!r}: one of debug, info, warning, error", fg=typer.colors.RED,
                        err=True)
            raise typer.Exit(code=2)
        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        bs, ctx, pre = _ints(batches, "--batches"), _ints(contexts, "--contexts"), _prefills(prefill)
        profiled = _kernel_rows(kernels)
        if not torch.cuda.is_available():
            typer.secho("error: muxd bench engine needs a CUDA device", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=2)
        if tensor_parallel_size > torch.cuda.device_count() or (multiplex and tensor_parallel_size > 1):
            typer.secho(f"error: --tensor-parallel-size {tensor_parallel_size} needs as many GPUs (this machine "
                        f"shows {torch.cuda.device_count()}) and runs without --multiplex (its replays time one GPU "
                        "alone)", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=2)
        config = Config.flat(max_num_seqs=max(bs + [b for b, _ in profiled]) + multiplex,  # + the prefill
                              max_num_batched_tokens=max(n for n, _ in pre),
                              max_model_len=max(max(n + c for n, c in pre), *ctx, *(c for _, c in profiled))
                              + iters + 64,
                              attention_backend=attention_backend, decode_kernel=decode_kernel, decode_blas=decode_blas,
                              fused_rope=fused_rope, pdl=pdl,
                              compile=compile, cuda_graph=cuda_graph, prefill_graph_rows=prefill_graph_rows,
                              async_scheduling=async_scheduling, tensor_parallel_size=tensor_parallel_size)
        result = engine_bench.run(model, load_format=load_format, dtype=dtype, batches=bs, contexts=ctx,
                                  prefills=pre, iters=iters, config=config,
                                  startup_only=startup_only or multiplex, sync_rows=compare_sync,
                                  kernels=profiled)
        try:
            table = engine_bench.render(result)
            if multiplex:
                table = multiplex_bench.run_multiplex(result, granularity, batch=max(bs), context=ctx[0],
                                                   prefill_tokens=max(n for n, _ in pre), iters=iters)
        finally:
            result.bench.engine.close()
        if json_out:
            engine_bench.save(result, json_out)
        if markdown_out:
            with open(markdown_out, "w") as f:
                f.write(table + "\n")
        typer.echo(table)
