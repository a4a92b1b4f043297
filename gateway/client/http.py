"""Deprecated alias of ``kvgw_client.http`` (see ``gateway.client``)."""

from gateway.client import alias

alias(__name__)
