"""Deprecated alias of ``kvgw_client.health`` (see ``gateway.client``)."""

from gateway.client import alias

alias(__name__)
