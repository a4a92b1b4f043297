"""Deprecated alias of ``kvgw_client.config`` (see ``gateway.client``)."""

from gateway.client import alias

alias(__name__)
