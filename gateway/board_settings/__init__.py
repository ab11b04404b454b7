"""Per-board settings: the ``edge-gateway-settings.toml`` an operator drops on the boot partition (README
"Per-board settings"), merged over the image's configuration and installed on the data partition.

- :mod:`gateway.board_settings.model`: sans-I/O: parse the file, merge it over the image's ``gateway.toml`` and
  ``bridge.toml``, write TOML, keep secrets out of messages.
- :mod:`gateway.board_settings.install`: the file moves: a new generation directory on the data partition, checked
  with the code ``check-config`` runs, swapped in with one rename; the boot partition's file removed or rejected.
- :mod:`gateway.board_settings.cli`: ``edge-gateway settings apply | check | host-keys``.
"""
