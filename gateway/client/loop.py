"""Deprecated alias of ``kvgw_client.loop`` (see ``gateway.client``)."""

from gateway.client import alias

alias(__name__)
