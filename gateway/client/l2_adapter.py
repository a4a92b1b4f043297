"""Deprecated alias of ``kvgw_client.lmcache.l2_adapter`` (see ``gateway.client``)."""

from gateway.client import alias

alias(__name__)
