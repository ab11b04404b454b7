"""Authentication and authorisation building blocks, pure logic with no I/O but reading the files named.

- :mod:`gateway.auth.passwd`: Mosquitto's ``password_file`` (``mosquitto_passwd(1)``), read, verified and written.
- :mod:`gateway.auth.throttle`: how long to delay a CONNECT from an address after failed attempts.
- :mod:`gateway.auth.acl`: Mosquitto's ``acl_file`` (``mosquitto.conf(5)``), publish/receive/subscribe decisions.
- :mod:`gateway.auth.tls`: the :class:`ssl.SSLContext` of a TLS listener and the client certificate's CN.
"""
