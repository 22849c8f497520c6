"""`muxd serve` (the OpenAI-compatible server; its flags are the config's fields, appliance/config.py) and
`muxd generate` (one prompt, streamed to the terminal)."""
from __future__ import annotations

import functools
import logging
import logging.config
import os
import sys
import threading
from pathlib import Path
from typing import Any, Optional

import typer

from appliance import __version__
from appliance.cluster.deploy import require_ray, run
from appliance.cluster.settings import ClusterSettings
from appliance.config import Config
from appliance.config_flags import ServeCommand, with_serve_flags
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams
from appliance.errors import ApplianceError, ConfigError
from appliance.server.api import create_app
from appliance.server.http import HeaderDeadlineProtocol, QuietPaths
from appliance.server.lifecycle import DrainingServer, leave_if_loading

FATAL_EXIT_S = 30.0  # after a fatal error, how long the server may take to end before the process exits anyway


def fail(exc: ApplianceError) -> None:
    typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


def serve(config: Config, model_tag: Optional[str] = typer.Argument(
        None, metavar="MODEL", help="Model directory (or 'embedded'), as `vllm serve MODEL`; the same as --model.",
        show_default=False),
        replicas: int = typer.Option(1, "--replicas", help="Engine replicas: above 1, serve them on Ray Serve behind "
                                     "one endpoint, as `muxd cluster --replicas N` (see `muxd cluster --help`)."),
        ray: Optional[str] = typer.Option(None, "--ray", help="Join this Ray cluster and serve replicas there, as "
                                          "`muxd cluster --ray ADDRESS`.")) -> None:
    """Start the OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /tokenize,
    /detokenize, /version, /health, /ready, /metrics)."""
    import uvicorn  # defers the server's libraries to `serve`

    if replicas != 1 or ray is not None:
        run_cluster(config, model_tag, {"replicas": replicas, "ray_address": ray})
        return
    try:
        config = with_model_tag(config, model_tag)
        config.check_served_context(config.check())
    except ApplianceError as exc:
        fail(exc)
    srv = config.server
    log_config = config.vllm.log_config()
    if log_config is None:
        logging.basicConfig(level=srv.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    else:
        try:
            logging.config.dictConfig(log_config)
        except (ValueError, TypeError, AttributeError, ImportError) as exc:
            fail(ConfigError(f"--log-config-file {config.vllm.log_config_file}: {exc}"))
    fatal: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_fatal(exc: BaseException) -> None:
        fatal.append(exc)
        if server is not None:
            server.should_exit = True
        # a rank lost in the middle of a collective can leave a GPU stream that never ends: leave regardless
        timer = threading.Timer(FATAL_EXIT_S, os._exit, (1,))
        timer.daemon = True
        timer.start()

    app = create_app(config, on_fatal)
    http = functools.partial(HeaderDeadlineProtocol, header_timeout=srv.header_timeout,
                             max_header_count=srv.h11_max_header_count)
    tls: dict[str, Any] = {}
    if srv.ssl_certfile:
        tls = {"ssl_keyfile": srv.ssl_keyfile, "ssl_certfile": srv.ssl_certfile, "ssl_ca_certs": srv.ssl_ca_certs,
               "ssl_cert_reqs": srv.ssl_cert_reqs}
        if srv.ssl_ciphers:  # (else uvicorn's default list)
            tls["ssl_ciphers"] = srv.ssl_ciphers
    server = DrainingServer(uvicorn.Config(app, host=srv.host, port=srv.port, uds=srv.uds, http=http,
                                           log_level=config.vllm.uvicorn_log_level or srv.log_level,
                                           access_log=not config.vllm.disable_uvicorn_access_log,
                                           h11_max_incomplete_event_size=srv.h11_max_incomplete_event_size,
                                           log_config=log_config,
                                           timeout_graceful_shutdown=5, **tls), app.state.muxd, srv.shutdown_timeout)
    quiet = config.vllm.quiet_paths()
    if quiet:  # (after uvicorn's Config has set up its loggers)
        logging.getLogger("uvicorn.access").addFilter(QuietPaths(quiet))
    where = f"unix socket {srv.uds}" if srv.uds else f"{'https' if tls else 'http'}://{srv.host}:{srv.port}"
    typer.echo(f"muxd {__version__}: serving {config.model.model_name} on {where} (loading the model; GET /ready "
               "turns 200 when it is up)")
    server.run()
    if fatal:
        typer.secho(f"error: {fatal[0]}", fg=typer.colors.RED, err=True)
    leave_if_loading(1 if fatal else 0)
    if fatal:
        raise typer.Exit(code=1)


def run_cluster(config: Config, model_tag: str | None, cluster_flags: dict[str, Any]) -> None:
    """`muxd cluster` (and `muxd serve --replicas N`): check everything, then serve the replicas until a signal."""
    try:
        config = with_model_tag(config, model_tag)
        settings = ClusterSettings(**cluster_flags)
        srv = config.server
        if srv.ssl_certfile or srv.uds:
            raise ConfigError("--ssl-keyfile/--ssl-certfile and --uds apply to one server; replicas are served by "
                              "Ray Serve's HTTP proxy (terminate TLS in front of it)")
        config.check_served_context(config.check())
        require_ray()
    except ApplianceError as exc:
        fail(exc)
    logging.basicConfig(level=config.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run(config, settings, typer.echo)


def with_model_tag(config: Config, model_tag: str | None) -> Config:
    """`muxd serve MODEL`: the positional model, which --model may repeat but not contradict."""
    if model_tag is None:
        names = config.model.served_model_name or ()
        if config.model.model == "embedded" and any((Path(n).expanduser() / "config.json").is_file() for n in names):
            # `--served-model-name a b` takes every word up to the next flag, as vLLM's: a model after it is a name
            raise ConfigError(f"--served-model-name took the model directory {names[-1]!r} as a name: give MODEL "
                              "before --served-model-name, or as --model")
        return config
    if config.model.model not in ("embedded", model_tag):
        raise ConfigError(f"the model is given twice: {model_tag!r} and --model {config.model.model!r}; give it "
                          "once")
    return config.replace(model=model_tag)


def generate(
    prompt: str = typer.Argument(..., help="Prompt text."),
    model: str = typer.Option("embedded", "--model", "-m", help="Model directory, or 'embedded'."),
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

    try:
        config = Config.flat(model=model, dtype=dtype, device=device, load_format=load_format, max_num_seqs=1)
        config.check()
        engine = build_engine(config)
        text: str | list[int] = prompt
        if chat or system is not None:
            if engine.tokenizer is None:
                raise ApplianceError("--chat and --system need a tokenizer; this model directory has no "
                                     "tokenizer.json")
            messages = [{"role": "user", "content": prompt}]
            if system is not None:
                messages.insert(0, {"role": "system", "content": system})
            text = engine.tokenizer.encode_chat(engine.tokenizer.render_chat(messages))
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                stop=list(stop or []))
        rid = engine.add_request(text, params)
    except ApplianceError as exc:
        fail(exc)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                sys.stdout.write(out.new_text if engine.tokenizer else f"{out.new_token_ids[0]} ")
                sys.stdout.flush()
    sys.stdout.write("\n")


def register(app: typer.Typer) -> None:
    app.command("serve", cls=ServeCommand)(with_serve_flags(serve, on_error=fail))
    app.command("generate")(generate)
