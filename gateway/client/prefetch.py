"""Deprecated alias of ``kvgw_client.prefetch`` (see ``gateway.client``)."""

from gateway.client import alias

alias(__name__)
