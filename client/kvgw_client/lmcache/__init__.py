"""LMCache integrations (``pip install kvgw-client[lmcache]``): both modules import lmcache.

* ``connector``: ``KvgwConnector`` / ``KvgwConnectorAdapter``, the in-process remote connector.
* ``l2_adapter``: ``KvgwNativeClient`` / ``KvgwL2Adapter``, the multiprocess server's L2 adapter.

This package itself imports nothing, so naming it in a config costs nothing until LMCache loads it.
"""
