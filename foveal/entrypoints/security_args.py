"""Who may call an HTTP entry point and how much, as configuration: `SecurityConfig`
and its flags (`--api-key` repeated or FOVEAL_API_KEY, `--rate-limit-rpm`,
`--max-concurrent-per-key`, `--max-request-bytes`), shared by `foveal serve` and
`foveal router`. Plain data and argparse only, so CLIs parse it without loading
the server; the middlewares that enforce it are in
foveal/entrypoints/openai/security.py."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from foveal.errors import ConfigError


@dataclass(frozen=True)
class SecurityConfig:
    api_keys: tuple[str, ...] = ()  # none: the API is open
    rate_limit_rpm: int | None = None  # requests per minute per client
    max_concurrent_per_key: int | None = None  # requests in flight per client
    max_request_bytes: int = 64 * 1024 * 1024  # images arrive base64 in the body

    def __post_init__(self) -> None:
        if not all(self.api_keys):
            raise ConfigError("--api-key: a key must not be empty")
        for flag, value in (("--rate-limit-rpm", self.rate_limit_rpm),
                            ("--max-concurrent-per-key", self.max_concurrent_per_key),
                            ("--max-request-bytes", self.max_request_bytes)):
            if value is not None and value < 1:
                raise ConfigError(f"{flag} {value}: must be >= 1")


def api_keys_from(flag_values: list[str] | None, environ=os.environ) -> tuple[str, ...]:
    """The keys: every --api-key given, else FOVEAL_API_KEY if set."""
    if flag_values:
        return tuple(flag_values)
    return (environ["FOVEAL_API_KEY"],) if environ.get("FOVEAL_API_KEY") else ()


def add_security_args(group) -> None:
    """The flags, on an argparse parser or argument group."""
    group.add_argument("--api-key", action="append",
                       help="require 'Authorization: Bearer KEY' on /v1/*; repeat the flag for "
                            "several keys (default: FOVEAL_API_KEY, if set)")
    group.add_argument("--rate-limit-rpm", type=int, metavar="N",
                       help="requests per minute per API key (per client IP without keys); "
                            "over it: 429 with Retry-After")
    group.add_argument("--max-concurrent-per-key", type=int, metavar="N",
                       help="requests in flight per API key (per client IP without keys)")
    group.add_argument("--max-request-bytes", type=int, default=64 * 1024 * 1024,
                       help="largest request body, in bytes (images arrive base64 in it)")


def security_config_from_args(args: argparse.Namespace) -> SecurityConfig:
    return SecurityConfig(api_keys=api_keys_from(args.api_key), rate_limit_rpm=args.rate_limit_rpm,
                          max_concurrent_per_key=args.max_concurrent_per_key,
                          max_request_bytes=args.max_request_bytes)
