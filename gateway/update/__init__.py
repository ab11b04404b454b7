"""Opt-in pull of A/B root updates (README "Pull updates").

- :mod:`gateway.update.plan`: the decisions, sans-I/O (manifest, versions, rejected versions, the maintenance
  window with ``now`` passed in, the free-space rule), tested in process.
- :mod:`gateway.update.settings`: the ``[update]`` table of gateway.toml, checked by ``edge-gateway check-config``.
- :mod:`gateway.update.fetch`: HTTPS (the standard library's ``ssl`` and ``urllib``): the manifest, and the bundle
  with Range resume.
- :mod:`gateway.update.pull`: ``edge-gateway update pull``: files, the space check, the install and reboot commands.
"""
