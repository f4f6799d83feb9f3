//! vLLM's `kv_transfer_params` dict, read and written with the same field names.

use serde::{Deserialize, Serialize};

use crate::error::{HandoffError, ParamsError};
use crate::handoff::ChildHandoff;
use crate::ids::LeaseToken;
use crate::BlockId;

/// `remote_block_ids` as vLLM writes it: a flat list, or one list per KV-cache group
/// (hybrid models).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RemoteBlockIds {
    /// One list of block ids.
    Flat(Vec<BlockId>),
    /// One list per KV-cache group.
    Grouped(Vec<Vec<BlockId>>),
}

/// vLLM's `kv_transfer_params`, plus kvxfer's own `kvxfer_*` fields. Every field may be
/// null or absent (the request-side form has most of them null); unknown fields are kept
/// and written back.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KvTransferParams {
    /// The decode side should pull from a remote prefill.
    #[serde(default, deserialize_with = "null_as_false")]
    pub do_remote_prefill: bool,
    /// The prefill side should keep the blocks for a remote decode.
    #[serde(default, deserialize_with = "null_as_false")]
    pub do_remote_decode: bool,
    /// The prefill blocks holding the request's KV cache.
    #[serde(default)]
    pub remote_block_ids: Option<RemoteBlockIds>,
    /// The prefill engine's id.
    #[serde(default)]
    pub remote_engine_id: Option<String>,
    /// The id the prefill side expects in the done-notification.
    #[serde(default)]
    pub remote_request_id: Option<String>,
    /// The prefill agent's host.
    #[serde(default)]
    pub remote_host: Option<String>,
    /// The prefill agent's port. Read from a number or from a string of digits: proxies
    /// that build the dict from environment variables or URL parts send `"5559"`, and vLLM's
    /// own connector accepts that (it only formats the value into an address), so kvxfer
    /// does too. Always written back as a number.
    #[serde(default, deserialize_with = "port_number_or_string")]
    pub remote_port: Option<u32>,
    /// Tensor-parallel size of the prefill engine.
    #[serde(default)]
    pub tp_size: Option<u32>,
    /// kvxfer: the lease token, 32 hex digits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvxfer_lease_token: Option<String>,
    /// kvxfer: the parent request id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvxfer_parent_request_id: Option<String>,
    /// kvxfer: this child's index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvxfer_child_index: Option<u32>,
    /// kvxfer: the parent's number of children.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvxfer_n: Option<u32>,
    /// kvxfer: consumers that must notify.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvxfer_expected_consumers: Option<u32>,
    /// kvxfer: lease time-to-live in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvxfer_lease_ttl_ms: Option<u64>,
    /// kvxfer: the issuing prefill agent process's incarnation (below 2^53, so exact in any
    /// JSON parser); absent or 0: not stated, only the engine id is checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvxfer_incarnation: Option<u64>,
    /// Fields neither vLLM's connector nor kvxfer define, kept as they came.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

fn port_number_or_string<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Port {
        Number(u32),
        Text(String),
    }
    match Option::<Port>::deserialize(d) {
        Ok(None) => Ok(None),
        Ok(Some(Port::Number(p))) => Ok(Some(p)),
        Ok(Some(Port::Text(s))) => s.trim().parse::<u32>().map(Some).map_err(|_| {
            serde::de::Error::custom(format!("{s:?} is not a port number (digits, or a JSON number)"))
        }),
        Err(_) => {
            Err(serde::de::Error::custom("expected a port number (a JSON number or a string of digits)"))
        }
    }
}

fn null_as_false<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(Option::<bool>::deserialize(d)?.unwrap_or(false))
}

impl KvTransferParams {
    /// Parses the dict from JSON. An error names the field whose value failed.
    pub fn from_json(s: &str) -> Result<Self, ParamsError> {
        let mut de = serde_json::Deserializer::from_str(s);
        let p: Self = serde_path_to_error::deserialize(&mut de)
            .map_err(|e| ParamsError::Json { field: e.path().to_string(), source: e.into_inner() })?;
        // Trailing characters after the dict.
        de.end().map_err(|source| ParamsError::Json { field: ".".into(), source })?;
        Ok(p)
    }

    /// Parses the dict from a JSON value already built (an embedding that holds the dict as
    /// data, not text: the Python binding), with the same field rules as [`Self::from_json`].
    pub fn from_value(v: serde_json::Value) -> Result<Self, ParamsError> {
        serde_path_to_error::deserialize(v)
            .map_err(|e| ParamsError::Json { field: e.path().to_string(), source: e.into_inner() })
    }

    /// Writes the dict as JSON.
    pub fn to_json(&self) -> String {
        // Serializing plain data to a string cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The dict a decode worker receives for a child.
    pub fn from_handoff(h: &ChildHandoff) -> Self {
        KvTransferParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            // A single group as the flat list vLLM writes for it; several nested.
            remote_block_ids: Some(if h.num_groups() == 1 {
                RemoteBlockIds::Flat(h.remote_block_ids().to_vec())
            } else {
                RemoteBlockIds::Grouped(h.groups().map(<[BlockId]>::to_vec).collect())
            }),
            remote_engine_id: Some(h.engine().engine_id.clone()),
            remote_request_id: Some(h.remote_request_id().to_owned()),
            // A hand-off naming only the engine id has neither.
            remote_host: Some(h.engine().host.clone()).filter(|_| h.engine().names_address()),
            remote_port: Some(u32::from(h.engine().port)).filter(|_| h.engine().names_address()),
            tp_size: Some(h.engine().tp_size),
            kvxfer_lease_token: Some(h.token().to_hex()),
            kvxfer_parent_request_id: Some(h.parent_request_id().to_owned()),
            kvxfer_child_index: Some(h.child_index()),
            kvxfer_n: Some(h.n()),
            kvxfer_expected_consumers: Some(h.expected_consumers()),
            kvxfer_lease_ttl_ms: Some(crate::handoff::ttl_ms(h.ttl())),
            kvxfer_incarnation: Some(h.engine().incarnation).filter(|&i| i != 0),
            extra: serde_json::Map::new(),
        }
    }

    /// The hand-off these params describe. A dict written by plain vLLM (no `kvxfer_*`
    /// fields) has no lease token and cannot be pulled through kvxfer. Every error names
    /// the dict's key (`kvxfer_parent_request_id`, not the wire's `parent_request_id`).
    pub fn to_handoff(&self) -> Result<ChildHandoff, ParamsError> {
        fn need<T>(o: Option<T>, name: &'static str) -> Result<T, ParamsError> {
            o.ok_or(ParamsError::Missing(name))
        }
        fn text(o: &Option<String>, name: &'static str) -> Result<String, ParamsError> {
            need(o.clone().filter(|s| !s.is_empty()), name)
        }
        let request = text(&self.remote_request_id, "remote_request_id")?;
        let parent = match &self.kvxfer_parent_request_id {
            None => request.clone(),
            Some(_) => text(&self.kvxfer_parent_request_id, "kvxfer_parent_request_id")?,
        };
        // One list per KV-cache group: group 0 in `remote_block_ids`, the rest after it.
        let (blocks, other_groups) = match need(self.remote_block_ids.clone(), "remote_block_ids")? {
            RemoteBlockIds::Flat(v) => (v, Vec::new()),
            RemoteBlockIds::Grouped(groups) if groups.is_empty() => (Vec::new(), Vec::new()),
            RemoteBlockIds::Grouped(mut groups) => {
                let first = groups.remove(0);
                (
                    first,
                    groups
                        .into_iter()
                        .map(|block_ids| kvxfer_proto::v1::GroupBlockIds { block_ids })
                        .collect(),
                )
            }
        };
        // Neither `remote_host` nor `remote_port`: the dict names only the engine id, which a
        // decode agent resolves through discovery.
        let engine_only = self.remote_host.as_deref().is_none_or(str::is_empty) && self.remote_port.is_none();
        let (host, port) = if engine_only {
            text(&self.remote_engine_id, "remote_engine_id")?;
            (String::new(), 0)
        } else {
            (text(&self.remote_host, "remote_host")?, need(self.remote_port, "remote_port")?)
        };
        let token = LeaseToken::from_hex(&need(self.kvxfer_lease_token.clone(), "kvxfer_lease_token")?)
            .map_err(|e| ParamsError::invalid("kvxfer_lease_token", e))?;
        let n = self.kvxfer_n.unwrap_or(1);
        let wire = kvxfer_proto::v1::ChildHandoff {
            parent_request_id: parent,
            child_index: self.kvxfer_child_index.unwrap_or(0),
            n,
            remote_request_id: request,
            lease_token: token.as_bytes().to_vec(),
            remote_block_ids: blocks,
            remote_engine_id: need(self.remote_engine_id.clone(), "remote_engine_id")?,
            remote_host: host,
            remote_port: port,
            expected_consumers: self.kvxfer_expected_consumers.unwrap_or(1),
            lease_ttl_ms: self.kvxfer_lease_ttl_ms.unwrap_or(30_000),
            tp_size: self.tp_size.unwrap_or(1),
            incarnation: self.kvxfer_incarnation.unwrap_or(0),
            other_group_block_ids: other_groups,
        };
        ChildHandoff::from_wire(wire).map_err(|e| {
            // The wire's field names mapped to this dict's keys.
            let field = match &e {
                HandoffError::BadPort { .. } => "remote_port",
                HandoffError::NoConsumers(_) => "kvxfer_expected_consumers",
                HandoffError::ZeroTtl(_) => "kvxfer_lease_ttl_ms",
                HandoffError::BadTokenLength(_) | HandoffError::BadTokenHex(_) => "kvxfer_lease_token",
                HandoffError::MissingField("parent_request_id") => "kvxfer_parent_request_id",
                HandoffError::MissingField(f) => f,
                // Errors of whole prefill results; `from_wire` of one hand-off has none.
                HandoffError::ZeroChildren { .. } | HandoffError::IncompleteResult { .. } => {
                    "kv_transfer_params"
                }
            };
            ParamsError::invalid(field, e)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{EngineInfo, LeaseConfig, LeaseRequest, LeaseTable};
    use std::time::Instant;

    const DECODE_SIDE: &str = r#"{"do_remote_prefill": true, "do_remote_decode": false,
        "remote_block_ids": [91], "remote_engine_id": "75192ab7-d1c6-48cf-bd82-ccef4ba0e1d6",
        "remote_request_id": "cmpl-b9d6c33a-482061a8-551f-4964-925d-fc0925e9261b-0",
        "remote_host": "localhost", "remote_port": 5559, "tp_size": 1}"#;

    #[test]
    fn reads_vllm_decode_side_dict() {
        let p = KvTransferParams::from_json(DECODE_SIDE).expect("parses");
        assert!(p.do_remote_prefill);
        assert_eq!(p.remote_block_ids, Some(RemoteBlockIds::Flat(vec![91])));
        assert_eq!(p.remote_port, Some(5559));
        // Plain vLLM params carry no lease token: kvxfer says which field is missing.
        assert!(matches!(p.to_handoff(), Err(ParamsError::Missing("kvxfer_lease_token"))));
    }

    #[test]
    fn reads_request_side_form_with_nulls_and_keeps_unknown_fields() {
        let s = r#"{"do_remote_decode": true, "do_remote_prefill": null, "remote_engine_id": null,
            "remote_block_ids": null, "remote_host": null, "remote_port": null,
            "some_future_field": {"x": 1}}"#;
        let p = KvTransferParams::from_json(s).expect("parses");
        assert!(p.do_remote_decode && !p.do_remote_prefill);
        assert_eq!(p.remote_block_ids, None);
        assert_eq!(p.extra.get("some_future_field"), Some(&serde_json::json!({"x": 1})));
        let back: serde_json::Value = serde_json::from_str(&p.to_json()).expect("json");
        assert_eq!(back["some_future_field"]["x"], 1);
        assert_eq!(back["remote_host"], serde_json::Value::Null);
    }

    /// A dict given as a JSON value parses as its text does, and a bad field is named alike.
    #[test]
    fn a_json_value_parses_as_its_text() {
        for text in
            [DECODE_SIDE, r#"{"remote_block_ids": [[1, 2], [7]], "remote_port": "5559", "x": {"y": [1]}}"#]
        {
            let v: serde_json::Value = serde_json::from_str(text).expect("json");
            assert_eq!(
                KvTransferParams::from_value(v).expect("value"),
                KvTransferParams::from_json(text).expect("text")
            );
        }
        let bad = r#"{"remote_block_ids": [1, "two"]}"#;
        let field = |e: ParamsError| match e {
            ParamsError::Json { field, .. } => field,
            other => panic!("{other:?}"),
        };
        let from_text = field(KvTransferParams::from_json(bad).expect_err("text"));
        let from_value =
            field(KvTransferParams::from_value(serde_json::from_str(bad).expect("json")).expect_err("value"));
        assert_eq!(from_value, from_text);
    }

    #[test]
    fn grouped_block_ids_parse() {
        let p = KvTransferParams::from_json(r#"{"remote_block_ids": [[1, 2], [7]]}"#).expect("parses");
        assert_eq!(p.remote_block_ids, Some(RemoteBlockIds::Grouped(vec![vec![1, 2], vec![7]])));
    }

    #[test]
    fn ipv6_hosts_round_trip_with_or_without_brackets() {
        let mut p = KvTransferParams::from_json(DECODE_SIDE).expect("parses");
        p.kvxfer_lease_token = Some("00".repeat(16));
        for host in ["::1", "[::1]"] {
            p.remote_host = Some(host.into());
            let h = p.to_handoff().expect("handoff");
            assert_eq!((h.engine().host.as_str(), h.engine().addr()), ("::1", "[::1]:5559".to_owned()));
            assert_eq!(h.engine().incarnation, 0, "not stated");
            let back =
                KvTransferParams::from_json(&KvTransferParams::from_handoff(&h).to_json()).expect("json");
            assert_eq!(back.to_handoff().expect("handoff"), h);
            assert_eq!(back.kvxfer_incarnation, None);
        }
        p.remote_host = Some("127.0.0.1".into());
        assert_eq!(p.to_handoff().expect("handoff").engine().addr(), "127.0.0.1:5559");
    }

    #[test]
    fn nested_block_ids_round_trip_one_list_per_group() {
        let mut p = KvTransferParams::from_json(DECODE_SIDE).expect("parses");
        p.kvxfer_lease_token = Some("00".repeat(16));
        p.remote_block_ids = Some(RemoteBlockIds::Grouped(vec![vec![1, 2], vec![7]]));
        let h = p.to_handoff().expect("two groups");
        assert_eq!(h.num_groups(), 2);
        assert_eq!(
            (h.group_block_ids(0), h.group_block_ids(1), h.group_block_ids(2)),
            (Some(&[1, 2][..]), Some(&[7][..]), None)
        );
        let back = KvTransferParams::from_json(&KvTransferParams::from_handoff(&h).to_json()).expect("json");
        assert_eq!(back.remote_block_ids, Some(RemoteBlockIds::Grouped(vec![vec![1, 2], vec![7]])));
        assert_eq!(back.to_handoff().expect("handoff"), h);
        assert_eq!(ChildHandoff::from_wire(h.to_wire()).expect("wire"), h);
        // One group is what a non-hybrid model writes: accepted as its flat list, and
        // written back flat (the single-group wire and dict are unchanged).
        p.remote_block_ids = Some(RemoteBlockIds::Grouped(vec![vec![1, 2]]));
        let one = p.to_handoff().expect("one group");
        assert_eq!((one.remote_block_ids(), one.num_groups()), (&[1, 2][..], 1));
        assert_eq!(
            KvTransferParams::from_handoff(&one).remote_block_ids,
            Some(RemoteBlockIds::Flat(vec![1, 2]))
        );
        assert!(one.to_wire().other_group_block_ids.is_empty());
    }

    #[test]
    fn every_params_error_names_its_field() {
        for (json, field) in [
            (r#"{"remote_port": "x"}"#, "remote_port"),
            (r#"{"remote_port": -1}"#, "remote_port"),
            (r#"{"tp_size": "two"}"#, "tp_size"),
            (r#"{"remote_block_ids": [1, "a"]}"#, "remote_block_ids"),
            (r#"{"kvxfer_n": 1.5}"#, "kvxfer_n"),
            (r#"{"remote_host": 7}"#, "remote_host"),
        ] {
            let msg = KvTransferParams::from_json(json).expect_err(json).to_string();
            assert!(msg.contains(field), "{json}: {msg}");
        }
    }

    /// Review finding 13: every error of `to_handoff` names the `kv_transfer_params` key (not
    /// the wire field), and a lease ttl of 0 (a decode side would heartbeat every 10 ms) is
    /// refused naming its key.
    #[test]
    fn every_to_handoff_error_names_its_kv_transfer_params_key() {
        let mut good = KvTransferParams::from_json(DECODE_SIDE).expect("parses");
        good.kvxfer_lease_token = Some("00".repeat(16));
        good.to_handoff().expect("the base dict is fine");
        type Breaker = Box<dyn Fn(&mut KvTransferParams)>;
        let cases: Vec<(&str, Breaker)> = vec![
            ("remote_request_id", Box::new(|p| p.remote_request_id = Some(String::new()))),
            ("remote_request_id", Box::new(|p| p.remote_request_id = None)),
            ("kvxfer_parent_request_id", Box::new(|p| p.kvxfer_parent_request_id = Some(String::new()))),
            ("remote_host", Box::new(|p| p.remote_host = Some(String::new()))),
            ("remote_host", Box::new(|p| p.remote_host = None)),
            ("remote_block_ids", Box::new(|p| p.remote_block_ids = Some(RemoteBlockIds::Flat(vec![])))),
            (
                "remote_block_ids",
                Box::new(|p| p.remote_block_ids = Some(RemoteBlockIds::Grouped(vec![vec![]]))),
            ),
            ("remote_block_ids", Box::new(|p| p.remote_block_ids = None)),
            ("remote_engine_id", Box::new(|p| p.remote_engine_id = None)),
            ("remote_port", Box::new(|p| p.remote_port = Some(0))),
            ("remote_port", Box::new(|p| p.remote_port = Some(70_000))),
            ("kvxfer_expected_consumers", Box::new(|p| p.kvxfer_expected_consumers = Some(0))),
            ("kvxfer_lease_token", Box::new(|p| p.kvxfer_lease_token = Some("abc".into()))),
            ("kvxfer_lease_token", Box::new(|p| p.kvxfer_lease_token = Some("zz".repeat(16)))),
            ("kvxfer_lease_ttl_ms", Box::new(|p| p.kvxfer_lease_ttl_ms = Some(0))),
        ];
        for (key, break_it) in cases {
            let mut p = good.clone();
            break_it(&mut p);
            let e = p.to_handoff().expect_err(key);
            let field = match &e {
                ParamsError::Missing(f) => f.to_string(),
                ParamsError::Invalid { field, .. } => field.to_string(),
                other => panic!("{key}: {other:?}"),
            };
            assert_eq!(field, key, "{e}");
            assert!(e.to_string().contains(key), "{e}");
        }
    }

    #[test]
    fn a_dict_without_host_and_port_names_only_the_engine() {
        let mut p = KvTransferParams::from_json(DECODE_SIDE).expect("parses");
        p.kvxfer_lease_token = Some("00".repeat(16));
        p.kvxfer_incarnation = Some(7);
        let full = p.to_handoff().expect("handoff");
        assert!(full.engine().names_address());
        for host in [None, Some(String::new())] {
            p.remote_host = host;
            p.remote_port = None;
            let h = p.to_handoff().expect("engine-only handoff");
            assert!(!h.engine().names_address());
            assert_eq!(
                (h.engine().engine_id.as_str(), h.engine().incarnation),
                ("75192ab7-d1c6-48cf-bd82-ccef4ba0e1d6", 7)
            );
            assert_eq!(h, full.engine_only());
            // Written back without host and port, and the wire form round-trips.
            let json = KvTransferParams::from_handoff(&h).to_json();
            let back: serde_json::Value = serde_json::from_str(&json).expect("json");
            assert_eq!(
                (&back["remote_host"], &back["remote_port"]),
                (&serde_json::Value::Null, &serde_json::Value::Null)
            );
            assert_eq!(KvTransferParams::from_json(&json).expect("parses").to_handoff().expect("again"), h);
            let wire = h.to_wire();
            assert_eq!((wire.remote_host.as_str(), wire.remote_port), ("", 0));
            assert_eq!(ChildHandoff::from_wire(wire).expect("wire"), h);
        }
        // Only the engine id: it must be there.
        p.remote_engine_id = Some(String::new());
        assert!(matches!(p.to_handoff(), Err(ParamsError::Missing("remote_engine_id"))));
        let mut wire = full.engine_only().to_wire();
        wire.remote_engine_id.clear();
        assert_eq!(ChildHandoff::from_wire(wire), Err(HandoffError::MissingField("remote_engine_id")));
        // One of host and port without the other is still an error naming the missing one.
        let mut wire = full.to_wire();
        wire.remote_port = 0;
        assert!(matches!(ChildHandoff::from_wire(wire), Err(HandoffError::BadPort { port: 0, .. })));
        let mut wire = full.to_wire();
        wire.remote_host.clear();
        assert_eq!(ChildHandoff::from_wire(wire), Err(HandoffError::MissingField("remote_host")));
    }

    #[test]
    fn a_numeric_string_port_is_accepted() {
        let p = KvTransferParams::from_json(r#"{"remote_port": "5559"}"#).expect("parses");
        assert_eq!(p.remote_port, Some(5559));
        // Written back as a number, as vLLM writes it.
        assert!(p.to_json().contains(r#""remote_port":5559"#), "{}", p.to_json());
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(KvTransferParams::from_json("[1,2").is_err());
        assert!(KvTransferParams::from_json(r#"{"remote_port": "x"}"#).is_err());
    }

    #[test]
    fn unknown_numeric_fields_survive_a_second_round_trip() {
        // Found by the kv_transfer_params fuzzer: without serde_json's float_roundtrip,
        // 6.66666e54 read back as 6.666659999999999e54.
        let input = r#"{"":{"":{"": 66666600000000000000000410666660000000000000004100573057}}}"#;
        let once = KvTransferParams::from_json(input).expect("parses").to_json();
        let twice = KvTransferParams::from_json(&once).expect("parses").to_json();
        assert_eq!(once, twice);
    }

    #[test]
    fn handoff_round_trips_through_params() {
        let engine = EngineInfo {
            engine_id: "e1".into(),
            host: "127.0.0.1".into(),
            port: 7000,
            tp_size: 2,
            incarnation: 0x1f_ffff_ffff_fffe,
        };
        let table = LeaseTable::new(LeaseConfig::new(engine, 64), [1; 32]);
        let h = table
            .lease(LeaseRequest::new("R", 2, 3, vec![5, 6]).consumers(2), Instant::now())
            .expect("lease");
        let json = KvTransferParams::from_handoff(&h).to_json();
        let p = KvTransferParams::from_json(&json).expect("parses");
        assert_eq!(p.remote_request_id.as_deref(), Some("2_R"));
        assert_eq!(p.kvxfer_incarnation, Some(0x1f_ffff_ffff_fffe));
        assert_eq!(p.to_handoff().expect("handoff"), h);
        let mut bad = p.clone();
        bad.kvxfer_lease_token = Some("nothex".into());
        assert!(
            matches!(bad.to_handoff(), Err(ParamsError::Invalid { source: e, .. }) if matches!(*e, HandoffError::BadTokenHex(_)))
        );
        bad = p;
        bad.remote_port = Some(70000);
        assert!(
            matches!(bad.to_handoff(), Err(ParamsError::Invalid { source: e, .. }) if matches!(*e, HandoffError::BadPort { .. }))
        );
    }
}
