"""Deprecated alias of ``kvgw_client.chains`` (see ``gateway.client``)."""

from gateway.client import alias

alias(__name__)
