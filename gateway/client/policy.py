"""Deprecated alias of ``kvgw_client.policy`` (see ``gateway.client``)."""

from gateway.client import alias

alias(__name__)
