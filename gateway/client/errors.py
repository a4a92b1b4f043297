"""Deprecated alias of ``kvgw_client.errors`` (see ``gateway.client``)."""

from gateway.client import alias

alias(__name__)
