"""Deprecated alias of ``kvgw_client.blocking`` (see ``gateway.client``)."""

from gateway.client import alias

alias(__name__)
