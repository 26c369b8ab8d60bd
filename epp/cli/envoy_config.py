"""``epp envoy-config``: the Envoy bootstrap that routes through epp, with the settings that
must agree with epp's config derived from it, or ``--check FILE`` of an existing one (its
flags: ``epp.cli.envoy_config_flags``)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

from epp.cli.flags import load
from epp.errors import ConfigError


@dataclass(slots=True, frozen=True)
class EnvoyBootstrap:
    """What ``epp envoy-config`` prints, and the warnings it prints beside it."""

    yaml: str
    warnings: tuple[str, ...] = ()


def envoy_needs(args: argparse.Namespace) -> Any:
    """What epp, with ``--config`` / ``--max-body-bytes``, asks of Envoy (``EppNeeds``)."""
    from epp import envoyconfig as ec

    return ec.needs_from_config(load(args), args.max_body_bytes)


def envoy_bootstrap(args: argparse.Namespace) -> EnvoyBootstrap:
    """The bootstrap for ``args``: the settings that must agree with epp's config derived
    from it; raises ValueError naming a setting given that contradicts it."""
    from epp import envoyconfig as ec
    from epp.modelrouter.cli import envoy_pools

    def hosts(text: str) -> tuple[str, ...]:
        return tuple(a.strip() for a in text.split(",") if a.strip())

    given = {"message_timeout_s": args.message_timeout_s,
             "stream_idle_timeout_s": args.stream_idle_timeout_s,
             "max_request_bytes": args.max_request_bytes}  # fmt: skip
    try:
        pools = envoy_pools(args.pool, args.epp, args.pools)
    except ConfigError as exc:
        raise ValueError(f"{exc.field}: {exc.problem}") from None
    single = not pools
    # Failing open needs servers to fall back to: the default is 'open' with --pool (or
    # several pools), 'closed' without (an ORIGINAL_DST cluster only epp can fill).
    failure = args.failure or ("open" if pools or args.pool else "closed")
    if pools and args.response == "summary":
        raise ValueError("--response summary works with one pool: with several, each pool's "
                         "epp reads its responses full-duplex (the summary's access log would "
                         "reach one epp)")
    response = args.response or ("full-duplex" if pools else "summary")
    options = ec.EnvoyOptions(
        listen_address=args.host, listen_port=args.port, admin_port=args.admin_port,
        epp=hosts(",".join(args.epp) if single and args.epp else "127.0.0.1:9002"),
        pool=hosts(args.pool[0]) if single and args.pool else (), routing=args.routing,
        pools=pools, model_router=hosts(args.model_router),
        failure=failure, request_body=args.request_body, response=response,
        fallback_lb=args.fallback_lb, retries=args.retries,
        upstream_idle_timeout_s=args.upstream_idle_timeout_s,
        upstream_host_header=args.upstream_host_header, access_log=args.access_log,
        summary_flush_s=args.summary_flush_s,
        **{k: v for k, v in given.items() if v is not None},
    )  # fmt: skip
    needs = envoy_needs(args)
    options = ec.derive(options, needs, frozenset(k for k, v in given.items() if v is not None))
    found = ec.mismatches(options, needs)
    fatal = [m for m in found if m.fatal]
    if fatal:
        raise ValueError("; ".join(map(str, fatal)))
    header = ""
    if options.routing == "epp":
        source = f"--config {args.config}" if args.config else "its default config"
        header = (f"# For epp serve with {source}, Envoy needs: {needs.describe()}\n"
                  "# (epp envoy-config --config CONFIG derives them; --check FILE checks a "
                  "bootstrap)\n")  # fmt: skip
        if single and not args.pool and args.failure is None:
            header += ("# Fail-closed: no --pool was given, so while no epp answers Envoy "
                       "answers 500.\n# Give --pool HOST:PORT[,HOST:PORT] (the model servers) "
                       "to fail open to them instead.\n")  # fmt: skip
    return EnvoyBootstrap(ec.render_yaml(options, header), tuple(str(m) for m in found))


def envoy_config_from_args(args: argparse.Namespace) -> str:
    """The bootstrap's YAML (warnings dropped: see :func:`envoy_bootstrap`)."""
    return envoy_bootstrap(args).yaml


def check_envoy_bootstrap(args: argparse.Namespace) -> list[str]:
    """``epp envoy-config --check FILE``: each setting of FILE that contradicts epp's
    config, as a line (fatal ones first, prefixed ``error:``, then ``warning:``)."""
    import yaml

    from epp import envoyconfig as ec

    with open(args.check, encoding="utf-8") as f:
        try:
            doc = yaml.safe_load(f)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ValueError(f"not valid YAML: {problem}{where}") from None
    found = ec.mismatches(ec.options_of_bootstrap(doc), envoy_needs(args))
    return [f"{'error' if m.fatal else 'warning'}: {m}"
            for m in sorted(found, key=lambda m: not m.fatal)]  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Print the bootstrap (warnings on stderr), or check ``--check FILE``: the exit code
    (``--check``: 1 when FILE contradicts epp's config, 2 when it cannot be checked: not
    readable, not YAML, no ext_proc filter routing through epp)."""
    try:
        if args.check:
            try:
                lines = check_envoy_bootstrap(args)
            except (ValueError, OSError) as exc:
                print(f"epp envoy-config: --check {args.check}: {exc}", file=sys.stderr)
                return 2
            for line in lines:
                print(f"epp envoy-config: {args.check}: {line}", file=sys.stderr)
            if not lines:
                print(f"{args.check}: agrees with epp's config", file=sys.stderr)
            return 1 if any(line.startswith("error") for line in lines) else 0
        out = envoy_bootstrap(args)
    except (ValueError, ConfigError, OSError) as exc:
        print(f"epp envoy-config: {exc}", file=sys.stderr)
        return 2
    for warning in out.warnings:
        print(f"epp envoy-config: warning: {warning}", file=sys.stderr)
    sys.stdout.write(out.yaml)
    return 0
