//! The services around the engines: etcd, mooncake_master, the lmcache server, the proxy.

use super::pairs::{VLLM_DEFAULT_BLOCK_SIZE, engine_facts};
use super::ports::claim;
use crate::child_config::ChildSettings;
use crate::child_config::proxy::ProxyArgs;
use crate::connectors::{Connector, Endpoint, Needs, PortBook};
use crate::topology::{Device, EngineKind, Problem, Topology};
use crate::vocab::{
    GeneratedFile, Probe, ProxyProtocol, RestartPolicy, Role, Service, Shutdown, Version,
};
use std::collections::BTreeMap;
use std::path::Path;

/// A service with the defaults every support service shares.
fn support_service(
    name: &str,
    role: Role,
    node: &str,
    host: &str,
    argv: Vec<String>,
    probe: Probe,
) -> Service {
    Service {
        name: name.to_string(),
        role,
        node: node.to_string(),
        host: host.to_string(),
        argv,
        env: BTreeMap::new(),
        gpus: Vec::new(),
        gpu_memory_share: None,
        gpu_memory_note: None,
        ports: BTreeMap::new(),
        files: Vec::new(),
        depends_on: Vec::new(),
        probe,
        url: None,
        startup_timeout_s: 60,
        restart: RestartPolicy::default(),
        restart_with: Vec::new(),
        shutdown: Shutdown {
            signal: "SIGTERM".into(),
            timeout_s: 10,
        },
        dirs: Vec::new(),
        checks: Vec::new(),
        secret_env: Vec::new(),
        hidden_env: Vec::new(),
    }
}

/// The support endpoints a plan ended up with (for the connectors' files).
pub(super) struct SupportPlan {
    pub services: Vec<Service>,
    pub names: Vec<String>,
    pub etcd: Option<Endpoint>,
    pub master: Option<Endpoint>,
    pub master_http_metadata: Option<Endpoint>,
    pub lmcache: Option<Endpoint>,
}

/// What the shared services are planned for: what the connector needs of them, for which
/// vLLM, and which nodes reach which (their bind addresses).
pub(super) struct SupportFor<'a> {
    pub needs: &'a Needs,
    pub version: Option<&'a Version>,
    pub reach: &'a super::listen::Reach<'a>,
}

/// Plans etcd, mooncake_master and the lmcache server as the connector needs (or the
/// topology forces with `enabled = true`).
pub(super) fn plan_support(
    t: &Topology,
    head: &str,
    state_dir: &Path,
    what: SupportFor<'_>,
    ports: &mut PortBook,
    warnings: &mut Vec<String>,
) -> Result<SupportPlan, Problem> {
    let SupportFor {
        needs,
        version,
        reach,
    } = what;
    let mut out = SupportPlan {
        services: Vec::new(),
        names: Vec::new(),
        etcd: None,
        master: None,
        master_http_metadata: None,
        lmcache: None,
    };
    if t.etcd.enabled.unwrap_or(needs.etcd) {
        plan_etcd(t, head, state_dir, reach, ports, &mut out)?;
    }
    if t.mooncake_master.enabled.unwrap_or(needs.mooncake_master) {
        plan_mooncake_master(t, head, needs, reach, ports, &mut out)?;
    }
    if t.lmcache_server.enabled.unwrap_or(needs.lmcache_server) {
        plan_lmcache_server(t, head, version, reach, ports, warnings, &mut out)?;
    }
    Ok(out)
}

/// etcd, one member on its node: the transfer metadata server of Mooncake's transfer
/// engine, which engines on other nodes read.
fn plan_etcd(
    t: &Topology,
    head: &str,
    state_dir: &Path,
    reach: &super::listen::Reach<'_>,
    ports: &mut PortBook,
    out: &mut SupportPlan,
) -> Result<(), Problem> {
    let node = t.etcd.node.as_deref().unwrap_or(head);
    let host = t.nodes[node].clone();
    let (client, peer) = (t.etcd.client_port, t.etcd.peer_port);
    let member = format!("pdctl-{}", t.cluster);
    // Engines on other nodes read the transfer metadata; the peer port serves a
    // cluster of one member, which no other node joins.
    let client_bind = reach.addr(node, reach.engines_elsewhere(node));
    let client_url = format!("http://{client_bind}:{client}");
    let peer_url = format!("http://{}:{peer}", reach.addr(node, false));
    let argv = [
        "etcd",
        "--name",
        &member,
        "--data-dir",
        &state_dir.join("etcd-data").display().to_string(),
        "--listen-client-urls",
        &client_url,
        "--advertise-client-urls",
        &client_url,
        "--listen-peer-urls",
        &peer_url,
        "--initial-advertise-peer-urls",
        &peer_url,
        "--initial-cluster",
        &format!("{member}={peer_url}"),
        "--initial-cluster-state",
        "new",
        // One member: nothing to elect with, so do not wait out a 1-2 s election.
        "--heartbeat-interval",
        "10",
        "--election-timeout",
        "100",
    ]
    .map(String::from)
    .to_vec();
    let probe = Probe::Http {
        url: format!("{client_url}/health"),
        status: 200,
        body_contains: Some("true".into()),
    };
    let mut svc = support_service("etcd", Role::Etcd, node, &host, argv, probe);
    claim(ports, &host, client, "etcd", "client")?;
    claim(ports, &host, peer, "etcd", "peer")?;
    svc.ports = BTreeMap::from([("client".into(), client), ("peer".into(), peer)]);
    svc.url = Some(client_url);
    out.etcd = Some(Endpoint {
        host: client_bind,
        port: client,
    });
    out.names.push(svc.name.clone());
    out.services.push(svc);
    Ok(())
}

/// mooncake_master: the store's master (RPC, metrics, and its HTTP metadata server when
/// the connector reads the metadata over HTTP).
fn plan_mooncake_master(
    t: &Topology,
    head: &str,
    needs: &Needs,
    reach: &super::listen::Reach<'_>,
    ports: &mut PortBook,
    out: &mut SupportPlan,
) -> Result<(), Problem> {
    let m = &t.mooncake_master;
    let node = m.node.as_deref().unwrap_or(head);
    let host = t.nodes[node].clone();
    // The RPC (and HTTP metadata) port serve the engines; the metrics port only this
    // node's supervisor, which probes it.
    let bind = reach.addr(node, reach.engines_elsewhere(node));
    let metrics_bind = reach.addr(node, false);
    let mut argv: Vec<String> = vec![
        "mooncake_master".into(),
        "--rpc_address".into(),
        bind.clone(),
        "--rpc_port".into(),
        m.rpc_port.to_string(),
        "--metrics_host".into(),
        metrics_bind.clone(),
        "--metrics_port".into(),
        m.metrics_port.to_string(),
    ];
    claim(ports, &host, m.rpc_port, "mooncake-master", "rpc")?;
    claim(ports, &host, m.metrics_port, "mooncake-master", "metrics")?;
    let mut named = BTreeMap::from([
        ("rpc".to_string(), m.rpc_port),
        ("metrics".to_string(), m.metrics_port),
    ]);
    if needs.master_http_metadata {
        argv.extend([
            "--enable_http_metadata_server=true".into(),
            "--http_metadata_server_host".into(),
            bind.clone(),
            "--http_metadata_server_port".into(),
            m.http_metadata_port.to_string(),
        ]);
        claim(
            ports,
            &host,
            m.http_metadata_port,
            "mooncake-master",
            "http-metadata",
        )?;
        named.insert("http-metadata".into(), m.http_metadata_port);
        out.master_http_metadata = Some(Endpoint {
            host: bind.clone(),
            port: m.http_metadata_port,
        });
    }
    argv.extend(m.args.iter().cloned());
    let probe = Probe::Http {
        url: format!("http://{metrics_bind}:{}/health", m.metrics_port),
        status: 200,
        body_contains: None,
    };
    let mut svc = support_service(
        "mooncake-master",
        Role::MooncakeMaster,
        node,
        &host,
        argv,
        probe,
    );
    svc.ports = named;
    // The master needs etcd only in HA mode, which pdctl does not plan: start both at once.
    out.master = Some(Endpoint {
        host: bind,
        port: m.rpc_port,
    });
    out.names.push(svc.name.clone());
    out.services.push(svc);
    Ok(())
}

/// The lmcache server LMCache's remote backend talks to (not started under the
/// simulator, which hands KV over through a shared directory: said as a warning).
fn plan_lmcache_server(
    t: &Topology,
    head: &str,
    version: Option<&Version>,
    reach: &super::listen::Reach<'_>,
    ports: &mut PortBook,
    warnings: &mut Vec<String>,
    out: &mut SupportPlan,
) -> Result<(), Problem> {
    let l = &t.lmcache_server;
    let node = l.node.as_deref().unwrap_or(head);
    let host = t.nodes[node].clone();
    let bind = reach.addr(node, reach.engines_elsewhere(node));
    claim(ports, &host, l.port, "lmcache-server", "server")?;
    out.lmcache = Some(Endpoint {
        host: bind.clone(),
        port: l.port,
    });
    if t.engine.kind == EngineKind::Sim {
        warnings.push(
            "engine sim: the lmcache server is not started (the simulator hands KV over through a shared directory)"
                .into(),
        );
    } else {
        let (argv, env) =
            crate::connectors::lmcache_server_command(&t.engine.python, version, &bind, l.port);
        let probe = Probe::Tcp {
            host: bind.clone(),
            port: l.port,
        };
        let mut svc = support_service(
            "lmcache-server",
            Role::LmcacheServer,
            node,
            &host,
            argv,
            probe,
        );
        svc.ports = BTreeMap::from([("server".into(), l.port)]);
        svc.env.extend(env);
        out.names.push(svc.name.clone());
        out.services.push(svc);
    }
    Ok(())
}

/// Plans the proxy in front of the engines planned so far, and returns its settings
/// typed beside it: its settings in a generated config file (`files/proxy.toml` beside the control socket), its command
/// `pdctl proxy --config FILE`. The API keys stay out of it: the proxy takes them from the
/// environment the supervisor passes on.
#[allow(clippy::too_many_arguments)]
pub(super) fn plan_proxy(
    t: &Topology,
    node: &str,
    protocol: ProxyProtocol,
    version: Option<&crate::vocab::Version>,
    services: &[Service],
    handoff_leaves_tokens: u32,
    socket: &Path,
    ports: &mut PortBook,
) -> Result<(Service, ProxyArgs), Problem> {
    let host = t.nodes[node].clone();
    let p = &t.proxy;
    claim(ports, &host, p.port, "proxy", "http")?;
    let args = proxy_args(
        t,
        &host,
        protocol,
        version,
        services,
        handoff_leaves_tokens,
        socket,
    )?;
    let config = socket.with_file_name("files").join("proxy.toml");
    let argv = vec![
        crate::tools::SELF_PROGRAM.to_string(),
        "proxy".to_string(),
        "--config".to_string(),
        config.display().to_string(),
    ];
    let url = format!("http://{host}:{}", p.port);
    // Healthy once the pairs usable at its start have had their KV path warmed (for a
    // connector whose handshake is lazy), so `up` shows that step and waits for it.
    let probe = Probe::Http {
        url: format!("{url}/health?warmed"),
        status: 200,
        body_contains: None,
    };
    let mut svc = support_service("proxy", Role::Proxy, node, &host, argv, probe);
    svc.ports = BTreeMap::from([("http".into(), p.port)]);
    svc.url = Some(url);
    svc.files = vec![GeneratedFile {
        path: config,
        content: crate::child_config::to_file(&args),
    }];
    svc.secret_env = vec![crate::vocab::PROXY_ENGINE_KEY_VAR.to_string()];
    svc.depends_on = services
        .iter()
        .filter(|s| s.role.is_engine())
        .map(|s| s.name.clone())
        .collect();
    // 30 s to listen; where pairs are warmed, the time `/health?warmed` may wait on top.
    svc.startup_timeout_s = 30;
    if protocol.lazy_handshake() && !args.no_warmup {
        svc.startup_timeout_s += args.warmed_within_s;
    }
    Ok((svc, args))
}

/// vLLM's KV block size on CPUs when `--block-size` is not given (its CPU platform sets
/// 128; GPUs default to [`VLLM_DEFAULT_BLOCK_SIZE`]).
const VLLM_CPU_BLOCK_SIZE: u32 = 128;

/// The proxy's settings (its config file): the engines' URLs, the protocol, what judging
/// decode's answers needs, and the `[proxy]` keys with their defaults; fails on a key set
/// to 0 that must be at least 1.
fn proxy_args(
    t: &Topology,
    host: &str,
    protocol: ProxyProtocol,
    version: Option<&crate::vocab::Version>,
    services: &[Service],
    handoff_leaves_tokens: u32,
    socket: &Path,
) -> Result<ProxyArgs, Problem> {
    let p = &t.proxy;
    let urls = |role: Role| -> Vec<String> {
        services
            .iter()
            .filter(|s| s.role == role)
            .filter_map(|s| s.url.clone())
            .collect()
    };
    let d = ProxyArgs::default();
    let mut args = ProxyArgs {
        host: host.to_string(),
        port: p.port,
        prefill: urls(Role::Prefill),
        decode: urls(Role::Decode),
        bootstrap_ports: if protocol == ProxyProtocol::Mooncake {
            services
                .iter()
                .filter(|s| s.role == Role::Prefill)
                .filter_map(|s| s.ports.get("bootstrap").copied())
                .collect()
        } else {
            Vec::new()
        },
        protocol,
        kv_load_failure_policy: crate::connectors::load_failure_policy(&t.connector, version),
        handoff_leaves_tokens,
        // vLLM decodes get --enable-prompt-tokens-details (engines.rs); the simulator
        // always reports the details.
        decode_prompt_tokens_details: true,
        policy: p.policy,
        prefill_policy: p.prefill_policy,
        decode_policy: p.decode_policy,
        scrape_metrics: p.scrape_metrics,
        no_warmup: false,
        rate_limit: p.rate_limit,
        max_concurrent: p.max_concurrent,
        queue_size: p.queue_size,
        retries: p.retries.unwrap_or(d.retries),
        connect_timeout_ms: p.connect_timeout_ms.unwrap_or(d.connect_timeout_ms),
        prefill_timeout_s: p.prefill_timeout_s.unwrap_or(d.prefill_timeout_s),
        first_byte_timeout_s: p.first_byte_timeout_s.unwrap_or(d.first_byte_timeout_s),
        total_timeout_s: p.total_timeout_s.unwrap_or(d.total_timeout_s),
        max_body_bytes: p.max_body_bytes.unwrap_or(d.max_body_bytes),
        restart_wait_s: p.restart_wait_s.unwrap_or(d.restart_wait_s),
        migration_limit: p.migration_limit.unwrap_or(d.migration_limit),
        migration_max_tokens: p.migration_max_tokens.unwrap_or(d.migration_max_tokens),
        drain_grace_s: p.drain_grace_s.unwrap_or(d.drain_grace_s),
        header_read_timeout_s: p.header_read_timeout_s.unwrap_or(d.header_read_timeout_s),
        max_client_connections: p.max_client_connections.unwrap_or(d.max_client_connections),
        supervisor_socket: Some(socket.to_path_buf()),
        ..d
    };
    args.set_tcp(t.network);
    // The topology's network.* are checked with the topology; these are the [proxy] keys.
    if let Some(key) = args.first_zero() {
        return Err(Problem::new(format!("proxy.{key}"), "must be at least 1")
            .hint("leave it out for the default"));
    }
    Ok(args)
}

/// Prompt tokens a good KV handoff may leave a decode to compute, for the proxy's
/// recompute check: what the connector leaves (`conn`, [`Connector::decode_leaves`]) at
/// the largest KV block size among the planned engines (a pair whose sizes differ moves
/// blocks of the larger). The simulator's handoffs move whole blocks of its own size.
pub(super) fn handoff_leaves_tokens(
    t: &Topology,
    conn: &dyn Connector,
    services: &[Service],
    settings: &BTreeMap<String, ChildSettings>,
) -> u32 {
    let block = services
        .iter()
        .filter_map(|s| {
            let facts = engine_facts(s, settings.get(&s.name))?;
            let given = s.argv.iter().any(|a| a.starts_with("--block-size"));
            let cpu = t.engine.kind == EngineKind::Vllm && t.engine.device == Device::Cpu;
            Some(if cpu && !given {
                VLLM_CPU_BLOCK_SIZE
            } else {
                facts.block_size
            })
        })
        .max()
        .unwrap_or(VLLM_DEFAULT_BLOCK_SIZE);
    match t.engine.kind {
        EngineKind::Sim => block,
        EngineKind::Vllm => conn.decode_leaves(&t.connector, block),
    }
}
