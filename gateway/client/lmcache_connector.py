"""Deprecated alias of ``kvgw_client.lmcache.connector`` (see ``gateway.client``)."""

from gateway.client import alias

alias(__name__)
