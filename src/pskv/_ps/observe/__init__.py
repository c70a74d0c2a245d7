"""The observability wing of ``pskv._ps``: Prometheus registries and endpoints (``metrics``,
``series``, ``httpd``), slow-round and straggler logs (``stragglers``) and the observer that
lists a job's endpoints for ``pskv-top`` (``observer``). docs/observability.md.
"""
__all__: list[str] = []
