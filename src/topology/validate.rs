//! Checks serde cannot make: names that must exist, counts that must be positive, values
//! that must make sense together. Checks that need the vLLM version or the GPU inventory
//! happen while planning.

use super::{ConnectorKind, EngineKind, Problem, RoleSection, Topology};

/// The first problem found, if any.
pub fn check(t: &Topology, head: &str) -> Result<(), Problem> {
    check_names(t, head)?;
    check_role(t, "prefill", &t.prefill)?;
    check_role(t, "decode", &t.decode)?;
    check_placements(t)?;
    check_ports(t)?;
    check_network(t)?;
    check_engine(t)?;
    check_connector(t, head)?;
    check_proxy(t)?;
    check_rebalance(t)?;
    check_dashboard(t)?;
    Ok(())
}

/// `[dashboard]`: an IP address to bind, a real port, and not a port the head's proxy or
/// control channel listens on.
fn check_dashboard(t: &Topology) -> Result<(), Problem> {
    let d = &t.dashboard;
    if !d.enabled {
        return Ok(());
    }
    if let Some((key, message)) = d.problem() {
        return Err(Problem::new(format!("dashboard.{key}"), message));
    }
    let taken = [
        ("proxy.port", t.proxy.enabled.then_some(t.proxy.port)),
        (
            "control.port",
            (t.nodes.len() > 1).then_some(t.control.port),
        ),
    ];
    for (key, port) in taken {
        if port == Some(d.port) {
            return Err(Problem::new(
                "dashboard.port",
                format!(
                    "port {} is also {key}: the head cannot listen on it twice",
                    d.port
                ),
            )
            .also(key)
            .hint(format!(
                "leave dashboard.port out for its own default ({}) or choose a free port",
                crate::vocab::DEFAULT_DASHBOARD_PORT
            )));
        }
    }
    Ok(())
}

fn check_names(t: &Topology, head: &str) -> Result<(), Problem> {
    if t.cluster.is_empty()
        || !t
            .cluster
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        || t.cluster.starts_with('.')
    {
        return Err(
            Problem::new("cluster", format!("`{}` cannot name a cluster", t.cluster))
                .hint("use letters, digits, '-', '_' or '.' (it names the state directory)"),
        );
    }
    if t.model.name.trim().is_empty() {
        return Err(Problem::new("model.name", "the model name is empty")
            .hint("a Hugging Face id such as Qwen/Qwen2.5-1.5B-Instruct, or a local path"));
    }
    if t.model
        .served_name
        .as_deref()
        .is_some_and(|s| s.trim().is_empty())
    {
        return Err(Problem::new(
            "model.served_name",
            "the served name is empty",
        ));
    }
    if t.nodes.is_empty() {
        return Err(Problem::new("nodes", "no nodes are defined")
            .hint("add at least one: [nodes] main = \"127.0.0.1\""));
    }
    for (name, addr) in &t.nodes {
        if let Some(why) = node_name_problem(name) {
            return Err(Problem::new(
                format!("nodes.{name}"),
                format!("`{name}` cannot name a node: {why}"),
            )
            .hint(NODE_NAME_RULE));
        }
        if addr.trim().is_empty() || addr.contains(char::is_whitespace) || addr.contains('/') {
            return Err(Problem::new(
                format!("nodes.{name}"),
                format!("`{addr}` is not a host address"),
            )
            .hint("write an IP address or host name, without scheme or port"));
        }
    }
    if !t.nodes.contains_key(head) {
        return Err(unknown_node(t, "head", head));
    }
    for (name, to) in &t.ssh {
        let key = format!("nodes.{name}.ssh");
        if to.starts_with('-') {
            return Err(Problem::new(
                key,
                format!("`{to}` begins with `-`: ssh would read it as an option, not a destination"),
            )
            .hint("write user@host, or a host your ~/.ssh/config names; put ssh options in ~/.ssh/config or PDCTL_SSH_COMMAND"));
        }
        if to.trim().is_empty() || to.contains(char::is_whitespace) {
            return Err(
                Problem::new(key, format!("`{to}` is not an SSH destination"))
                    .hint("write user@host, or a host your ~/.ssh/config names"),
            );
        }
        if name == head {
            return Err(Problem::new(key, "the head is the node `pdctl up` runs on")
                .hint("remove `ssh` from the head: it is for the nodes the head starts"));
        }
    }
    Ok(())
}

/// The rule a node name follows, as `plan` says it when one does not.
pub const NODE_NAME_RULE: &str = "a node name is a DNS label: 1 to 63 characters, lowercase letters, digits and `-`, not beginning or ending with `-` (it names the node's state directory and its certificate)";

/// Why `name` cannot name a node (it is not a DNS label), or None when it can. Node names
/// become state directory names and certificate names, so nothing else gets through.
pub fn node_name_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("it is empty")
    } else if name.len() > 63 {
        Some("it is longer than 63 characters")
    } else if !name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        Some("it has a character other than a lowercase letter, a digit or `-`")
    } else if name.starts_with('-') || name.ends_with('-') {
        Some("it begins or ends with `-`")
    } else {
        None
    }
}

fn unknown_node(t: &Topology, key: &str, node: &str) -> Problem {
    let known: Vec<String> = t.nodes.keys().cloned().collect();
    let hint = match crate::spelling::suggestion(node, &known) {
        Some(s) => format!("did you mean `{s}`? nodes are: {}", known.join(", ")),
        None => format!("nodes are: {} (see [nodes])", known.join(", ")),
    };
    Problem::new(key, format!("unknown node `{node}`")).hint(hint)
}

fn check_role(t: &Topology, role: &str, r: &RoleSection) -> Result<(), Problem> {
    if r.instances == 0 {
        return Err(Problem::new(
            format!("{role}.instances"),
            "0 instances: a PD cluster needs at least one prefill and one decode instance",
        ));
    }
    if r.gpus_per_instance == 0 {
        return Err(Problem::new(
            format!("{role}.gpus_per_instance"),
            "must be at least 1 (it is the tensor-parallel size)",
        ));
    }
    if r.node.is_some() && r.nodes.is_some() {
        return Err(
            Problem::new(format!("{role}.nodes"), "both `node` and `nodes` are set")
                .hint("use `node` for one node or `nodes` to spread instances, not both"),
        );
    }
    if let Some(node) = &r.node
        && !t.nodes.contains_key(node)
    {
        return Err(unknown_node(t, &format!("{role}.node"), node));
    }
    if let Some(nodes) = &r.nodes {
        if nodes.is_empty() {
            return Err(Problem::new(
                format!("{role}.nodes"),
                "the node list is empty",
            ));
        }
        for (i, n) in nodes.iter().enumerate() {
            if !t.nodes.contains_key(n) {
                return Err(unknown_node(t, &format!("{role}.nodes[{i}]"), n));
            }
        }
    }
    if let Some(gpus) = &r.gpus {
        for (i, g) in gpus.iter().enumerate() {
            if gpus[..i].contains(g) {
                return Err(Problem::new(
                    format!("{role}.gpus[{i}]"),
                    format!("GPU {g} is listed twice"),
                ));
            }
        }
    }
    for (i, w) in r.restart_with.iter().enumerate() {
        if !names_a_service(t, w) {
            return Err(Problem::new(
                format!("{role}.restart_with[{i}]"),
                format!("`{w}` is neither a role nor a service of this cluster"),
            )
            .hint("use a role (prefill, decode) or a service name such as decode-0"));
        }
    }
    Ok(())
}

fn names_a_service(t: &Topology, name: &str) -> bool {
    let indexed = |prefix: &str, n: u32| {
        name.strip_prefix(prefix)
            .and_then(|i| i.parse::<u32>().ok())
            .is_some_and(|i| i < n)
    };
    matches!(name, "prefill" | "decode")
        || indexed("prefill-", t.prefill.instances)
        || indexed("decode-", t.decode.instances)
}

fn check_placements(t: &Topology) -> Result<(), Problem> {
    for (key, node) in [
        ("etcd.node", &t.etcd.node),
        ("mooncake_master.node", &t.mooncake_master.node),
        ("lmcache_server.node", &t.lmcache_server.node),
        ("proxy.node", &t.proxy.node),
    ] {
        if let Some(n) = node
            && !t.nodes.contains_key(n)
        {
            return Err(unknown_node(t, key, n));
        }
    }
    Ok(())
}

fn check_ports(t: &Topology) -> Result<(), Problem> {
    let ports = [
        ("etcd.client_port", Some(t.etcd.client_port)),
        ("etcd.peer_port", Some(t.etcd.peer_port)),
        ("mooncake_master.rpc_port", Some(t.mooncake_master.rpc_port)),
        (
            "mooncake_master.metrics_port",
            Some(t.mooncake_master.metrics_port),
        ),
        (
            "mooncake_master.http_metadata_port",
            Some(t.mooncake_master.http_metadata_port),
        ),
        ("lmcache_server.port", Some(t.lmcache_server.port)),
        ("proxy.port", Some(t.proxy.port)),
        ("control.port", Some(t.control.port)),
        ("prefill.base_port", t.prefill.base_port),
        ("decode.base_port", t.decode.base_port),
        ("connector.te_port", Some(t.connector.te_port)),
        ("connector.bootstrap_port", Some(t.connector.bootstrap_port)),
        ("connector.side_channel_port", t.connector.side_channel_port),
    ];
    for (key, port) in ports {
        if port == Some(0) {
            return Err(Problem::new(key, "port 0 is not a port a client can reach")
                .hint("choose a port between 1024 and 65535"));
        }
    }
    for (role, r) in [("prefill", &t.prefill), ("decode", &t.decode)] {
        if let Some(base) = r.base_port
            && u32::from(base) + r.instances - 1 > 65535
        {
            return Err(Problem::new(
                format!("{role}.base_port"),
                format!("{} instances from port {base} run past 65535", r.instances),
            ));
        }
    }
    Ok(())
}

fn check_network(t: &Topology) -> Result<(), Problem> {
    if let Some(name) = t.health.first_zero() {
        return Err(Problem::new(format!("health.{name}"), "must be at least 1")
            .hint("leave it out for the default (docs/supervisor.md says how it was chosen)"));
    }
    match t.network.first_zero() {
        Some(name) => Err(
            Problem::new(format!("network.{name}"), "must be at least 1")
                .hint("leave it out for the default, which finds a dead peer in about 10 s"),
        ),
        None => Ok(()),
    }
}

fn check_engine(t: &Topology) -> Result<(), Problem> {
    let e = &t.engine;
    if e.vllm_version != "auto"
        && let Err(err) = e.vllm_version.parse::<crate::vocab::Version>()
    {
        return Err(Problem::new("engine.vllm_version", err.to_string())
            .hint("write \"auto\" to ask the installed vLLM"));
    }
    if let Some(u) = e.gpu_memory_utilization
        && !(u > 0.0 && u <= 1.0)
    {
        return Err(Problem::new(
            "engine.gpu_memory_utilization",
            format!("{u} is not a fraction in (0, 1]"),
        ));
    }
    if e.instances_per_gpu == 0 {
        return Err(
            Problem::new("engine.instances_per_gpu", "must be at least 1")
                .hint("1 gives each instance GPUs of its own; 2 lets prefill and decode share one"),
        );
    }
    let s = &e.sim;
    for (key, v) in [
        ("engine.sim.prefill_ms_per_token", s.prefill_ms_per_token),
        ("engine.sim.overhead_ms", s.overhead_ms),
        ("engine.sim.itl_ms", s.itl_ms),
        ("engine.sim.batch_slowdown", s.batch_slowdown),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            return Err(Problem::new(key, format!("{v} must be a number >= 0")));
        }
    }
    if s.block_size == 0 {
        return Err(Problem::new("engine.sim.block_size", "must be at least 1"));
    }
    if s.max_num_seqs == 0 {
        return Err(Problem::new(
            "engine.sim.max_num_seqs",
            "must be at least 1",
        ));
    }
    check_context_length(t)
}

/// A simulated engine serves `model.max_model_len` when it is set, so a different
/// `engine.sim.max_model_len` beside it would be silently ignored: refused instead.
/// (`engine.sim.max_model_len` left at its default of 8192 is not a contradiction.)
fn check_context_length(t: &Topology) -> Result<(), Problem> {
    let (Some(model), sim) = (t.model.max_model_len, t.engine.sim.max_model_len) else {
        return Ok(());
    };
    if model == 0 {
        return Err(Problem::new("model.max_model_len", "must be at least 1"));
    }
    let default = crate::vocab::SimModel::default().max_model_len;
    if t.engine.kind == EngineKind::Sim && sim != default && sim != model {
        return Err(Problem::new(
            "engine.sim.max_model_len",
            format!(
                "{sim} contradicts model.max_model_len = {model}, which the simulated engines serve"
            ),
        )
        .hint("remove engine.sim.max_model_len, or set both to the same value"));
    }
    Ok(())
}

fn check_connector(t: &Topology, head: &str) -> Result<(), Problem> {
    let c = &t.connector;
    if c.transport == super::Transport::Rdma && c.device_name.is_empty() {
        return Err(Problem::new(
            "connector.device_name",
            "rdma needs the RDMA device names (e.g. \"mlx5_0\" or \"erdma_0\")",
        ));
    }
    if c.kind == ConnectorKind::Example && c.shared_storage_path.is_none() {
        // A role placed nowhere runs on the head node.
        let nodes_of = |r: &RoleSection| -> Vec<String> {
            r.nodes
                .clone()
                .unwrap_or_else(|| vec![r.node.clone().unwrap_or_else(|| head.to_string())])
        };
        let mut all = nodes_of(&t.prefill);
        all.extend(nodes_of(&t.decode));
        all.sort();
        all.dedup();
        if all.len() > 1 {
            return Err(Problem::new(
                "connector.shared_storage_path",
                "instances run on several nodes, so the KV directory must be a path every node shares",
            )
            .hint("set it to a shared filesystem path, e.g. \"/mnt/pd_kv\"")
            .also("connector")
            .also("decode.node")
            .also("decode.nodes")
            .also("prefill.node")
            .also("prefill.nodes"));
        }
    }
    Ok(())
}

fn check_proxy(t: &Topology) -> Result<(), Problem> {
    let p = &t.proxy;
    crate::vocab::check_admission(p.rate_limit, p.max_concurrent, p.queue_size).map_err(|e| {
        Problem::new(
            format!("proxy.{}", e.setting()),
            e.message(|key| format!("proxy.{key}")),
        )
    })
}

/// `[rebalance]`: objectives that can be judged, one budget, bounds the budget and the
/// written split leave room for.
fn check_rebalance(t: &Topology) -> Result<(), Problem> {
    let Some(r) = &t.rebalance else {
        return Ok(());
    };
    for (key, v) in [("ttft_p90_ms", r.ttft_p90_ms), ("itl_p90_ms", r.itl_p90_ms)] {
        if let Some(v) = v
            && !(v.is_finite() && v > 0.0)
        {
            return Err(Problem::new(
                format!("rebalance.{key}"),
                format!("{v} is not a time in milliseconds above 0"),
            ));
        }
    }
    if r.ttft_p90_ms.is_none() && r.itl_p90_ms.is_none() {
        return Err(
            Problem::new("rebalance", "no objective: nothing to judge a split by")
                .hint("set `ttft_p90_ms`, `itl_p90_ms` or both, e.g. ttft_p90_ms = 2000"),
        );
    }
    if r.budget.is_some() && r.gpu_budget.is_some() {
        return Err(Problem::new(
            "rebalance.gpu_budget",
            "both `budget` and `gpu_budget` are set",
        )
        .also("rebalance.budget")
        .hint("count instances (`budget`) or GPUs (`gpu_budget`), not both"));
    }
    for (key, v) in [("min_prefill", r.min_prefill), ("min_decode", r.min_decode)] {
        if v == 0 {
            return Err(Problem::new(
                format!("rebalance.{key}"),
                "must be at least 1: a PD cluster needs both roles",
            ));
        }
    }
    if r.window_s == 0 {
        return Err(Problem::new(
            "rebalance.window_s",
            "must be at least 1 second",
        ));
    }
    if !(r.hysteresis_pct.is_finite() && (0.0..100.0).contains(&r.hysteresis_pct)) {
        return Err(Problem::new(
            "rebalance.hysteresis_pct",
            format!(
                "{} is not a percentage from 0 to below 100",
                r.hysteresis_pct
            ),
        )
        .hint(
            "the margin past an objective before it counts as missed, e.g. hysteresis_pct = 10",
        ));
    }
    let (gp, gd) = (t.prefill.gpus_per_instance, t.decode.gpus_per_instance);
    let least = (r.min_prefill, r.min_decode);
    let (key, budget, need) = match (r.budget, r.gpu_budget) {
        (Some(b), _) => ("budget", b, least.0 + least.1),
        (_, Some(g)) => ("gpu_budget", g, least.0 * gp + least.1 * gd),
        _ => return Ok(()),
    };
    if budget < need {
        return Err(Problem::new(
            format!("rebalance.{key}"),
            format!(
                "{budget} is less than the bounds need ({need}: min_prefill = {}, min_decode = {})",
                least.0, least.1
            ),
        )
        .also("rebalance.min_prefill"));
    }
    Ok(())
}
