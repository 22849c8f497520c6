"""`muxd cluster`: engine replicas on Ray Serve behind one OpenAI-compatible endpoint. Its flags are every `muxd
serve` flag (each replica's engine) plus the cluster's own, made from appliance/cluster/settings.py's fields; the
work is `run_cluster` in cli/serve.py, which `muxd serve --replicas N [--ray ADDRESS]` calls too."""
from __future__ import annotations

import inspect
from typing import Any, Optional

import typer

from appliance.cli.serve import fail, run_cluster
from appliance.cluster.settings import ClusterSettings
from appliance.config import Config
from appliance.config_flags import ServeCommand, dataclass_flags, with_serve_flags


def cluster(config: Config, model_tag: Optional[str] = None, **cluster_flags: Any) -> None:
    """Serve muxd engine replicas as a Ray Serve deployment behind one OpenAI-compatible endpoint (--host, --port),
    each replica a whole engine with every `muxd serve` flag; requests go to the replica with the least predicted
    TTFT (--router slo) or by power-of-two-choices (--router pow2); with --max-replicas, autoscaled on the
    replicas' queues and predicted wait. Needs `pip install 'muxd[cluster]'`."""
    run_cluster(config, model_tag, cluster_flags)


def _command() -> Any:
    model = inspect.Parameter("model_tag", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str],
                              default=typer.Argument(None, metavar="MODEL", show_default=False,
                                                     help="Model directory (or 'embedded'); the same as --model."))
    params = [inspect.Parameter("config", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Config), model,
              *dataclass_flags(ClusterSettings)]

    def command(config: Config, **kw: Any) -> None:
        cluster(config, **kw)

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__doc__ = cluster.__doc__
    return with_serve_flags(command, on_error=fail)


def register(app: typer.Typer) -> None:
    app.command("cluster", cls=ServeCommand)(_command())
