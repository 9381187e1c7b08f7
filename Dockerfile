# The pdctl image `pdctl export k8s` names by default (pdctl:<version>): pdctl for the proxy
# and the simulated engines, and mooncake_master for the Mooncake connectors. Built from this
# repository (Rust crates from crates.io) and PyPI alone:
#
#   docker build -t pdctl:0.1.0 .
#   docker tag pdctl:0.1.0 REGISTRY/pdctl:0.1.0 && docker push REGISTRY/pdctl:0.1.0
#   pdctl export k8s -p 4p4d --pdctl-image REGISTRY/pdctl:0.1.0
#
# The tag is the version in Cargo.toml; tests/export.rs checks that the two agree.

ARG RUST_VERSION=1.95
ARG DEBIAN_RELEASE=bookworm

FROM rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin pdctl

# Debian as install.sh expects it: mooncake_master links against libibverbs, libnuma and
# libcurl (also without RDMA hardware) and runs from a Python virtualenv.
FROM debian:${DEBIAN_RELEASE}-slim
ARG MOONCAKE_PACKAGE=mooncake-transfer-engine-non-cuda==0.3.13.post1
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      ca-certificates libibverbs1 libnuma1 libcurl4 python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/pdctl/venv \
 && /opt/pdctl/venv/bin/pip install --no-cache-dir --disable-pip-version-check "${MOONCAKE_PACKAGE}" \
 && /opt/pdctl/venv/bin/mooncake_master --version
# The manifests run programs by name: pdctl and mooncake_master must both be on PATH.
ENV PATH=/opt/pdctl/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
COPY --from=build /src/target/release/pdctl /usr/local/bin/pdctl
RUN pdctl --version
LABEL org.opencontainers.image.title="pdctl" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
CMD ["pdctl", "--help"]
