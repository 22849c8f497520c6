"""muxd beyond one machine: engine replicas as a Ray Serve deployment behind one OpenAI-compatible ingress.

The package owns the cluster settings, the routing hints an ingress derives from a request, the SLO-aware scoring of
replicas, the in-process ASGI call a replica serves with, the ingress's relay (retries, commit, errors), the Ray Serve
request router and autoscaling policy, and the deployment itself. Ray is an optional dependency (`muxd[cluster]`):
only `router.py`, `ray_backend.py` and `deploy.py` touch it, and only inside functions, so importing this package
never imports Ray.
"""
