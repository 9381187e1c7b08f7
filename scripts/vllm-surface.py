#!/usr/bin/env python3
"""Reads what pdctl's templates depend on out of a vLLM wheel's own source, without
installing or importing it, and prints it as JSON (tests/data/vllm-<version>-surface.json):

  flags        every "--flag" named in vllm/engine/arg_utils.py, the fields of the
               frontend argument classes (vllm/entrypoints/common/cli_args.py, or
               vllm/entrypoints/openai/cli_args.py in older trees; the server's own flags),
               and --no-FLAG where FLAG sets a boolean field of vllm/config/*.py
  kv_transfer_config_fields
               the fields of KVTransferConfig (vllm/config/kv_transfer.py)
  kv_load_failure_policy_default
               its default, when the field exists
  connectors   the names registered in vllm/distributed/kv_transfer/kv_connector/factory.py
  env          the environment variables vllm/envs.py reads
  modules      the python modules pdctl runs (-m) that the wheel has

usage: scripts/vllm-surface.py vllm-X.Y.Z-*.whl > tests/data/vllm-X.Y.Z-surface.json
(the wheel from `pip download vllm==X.Y.Z --no-deps`)
"""
import json
import re
import sys
import zipfile

RUN_MODULES = ["vllm.entrypoints.openai.api_server"]
FRONTEND_ARGS = [
    "vllm/entrypoints/common/cli_args.py",
    "vllm/entrypoints/openai/cli_args.py",
]


def main(wheel):
    z = zipfile.ZipFile(wheel)
    names = set(z.namelist())

    def read(path):
        return z.read(path).decode() if path in names else ""

    version = re.search(r"__version__ = version = '([^']+)'", read("vllm/_version.py"))
    flags = set()
    for f in ("vllm/engine/arg_utils.py", "vllm/entrypoints/openai/cli_args.py"):
        flags.update(re.findall(r'"(--[a-z0-9][a-z0-9-]*)"', read(f)))
    # The server's own flags are the fields of its frontend argument dataclasses
    # (FrontendArgs and its bases: add_cli_args writes "--" + field with - for _).
    for f in FRONTEND_ARGS:
        fields = re.findall(r"^    ([a-z_][a-z0-9_]*): ", read(f), re.M)
        flags.update("--" + x.replace("_", "-") for x in fields)
    # Boolean config fields get argparse.BooleanOptionalAction (get_kwargs in arg_utils.py),
    # which also accepts --no-FLAG.
    bools = set()
    for n in names:
        if n.startswith("vllm/config/") and n.endswith(".py"):
            bools.update(re.findall(r"^    ([a-z_][a-z0-9_]*): bool\b", read(n), re.M))
    flags.update(
        "--no-" + f[2:] for f in list(flags) if f[2:].replace("-", "_") in bools
    )
    kvt = read("vllm/config/kv_transfer.py")
    body = kvt.split("class KVTransferConfig", 1)[-1]
    fields = re.findall(r"^    ([a-z_][a-z0-9_]*): [^=\n]+(?:=|$)", body, re.M)
    policy = re.search(r'kv_load_failure_policy: [^=]+= "([a-z]+)"', kvt)
    factory = read("vllm/distributed/kv_transfer/kv_connector/factory.py")
    connectors = re.findall(r'register_connector\(\s*"([A-Za-z0-9_]+)"', factory)
    env = re.findall(r'^    "(VLLM_[A-Z0-9_]+)": ', read("vllm/envs.py"), re.M)
    modules = [
        m for m in RUN_MODULES if m.replace(".", "/") + ".py" in names
    ]
    json.dump(
        {
            "version": version.group(1) if version else None,
            "read_from": {
                "flags": ["vllm/engine/arg_utils.py"] + FRONTEND_ARGS,
                "kv_transfer_config_fields": "vllm/config/kv_transfer.py",
                "connectors": "vllm/distributed/kv_transfer/kv_connector/factory.py",
                "env": "vllm/envs.py",
            },
            "flags": sorted(flags),
            "kv_transfer_config_fields": sorted(set(fields)),
            "kv_load_failure_policy_default": policy.group(1) if policy else None,
            "connectors": sorted(set(connectors)),
            "env": sorted(set(env)),
            "modules": modules,
        },
        sys.stdout,
        indent=1,
    )
    print()


if __name__ == "__main__":
    main(sys.argv[1])
