//! Every protobuf message of kvxfer.v1 on arbitrary bytes (the first byte picks the
//! message): decoding never panics, and what decodes re-encodes to an equal message.
#![no_main]

use kvxfer_proto::v1;
use kvxfer_proto::Message;
use libfuzzer_sys::fuzz_target;

fn round_trip<M: Message + Default + PartialEq + std::fmt::Debug>(b: &[u8]) {
    if let Ok(m) = M::decode(b) {
        let again = M::decode(m.encode_to_vec().as_slice()).expect("re-encoded message decodes");
        assert_eq!(again, m);
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, b)) = data.split_first() else { return };
    match which % 23 {
        0 => round_trip::<v1::TransportOffer>(b),
        1 => round_trip::<v1::SegmentLayout>(b),
        2 => round_trip::<v1::BlockLayout>(b),
        3 => round_trip::<v1::Hello>(b),
        4 => round_trip::<v1::HelloAck>(b),
        5 => round_trip::<v1::ChildHandoff>(b),
        6 => round_trip::<v1::PrefillResult>(b),
        7 => round_trip::<v1::BlockRange>(b),
        8 => round_trip::<v1::ReadRequest>(b),
        9 => round_trip::<v1::ReadResponse>(b),
        10 => round_trip::<v1::PinAck>(b),
        11 => round_trip::<v1::Unpin>(b),
        12 => round_trip::<v1::UnpinAck>(b),
        13 => round_trip::<v1::UcxInfo>(b),
        14 => round_trip::<v1::UcxRegion>(b),
        15 => round_trip::<v1::Notify>(b),
        16 => round_trip::<v1::NotifyAck>(b),
        17 => round_trip::<v1::LeaseRef>(b),
        18 => round_trip::<v1::Heartbeat>(b),
        19 => round_trip::<v1::HeartbeatAck>(b),
        20 => round_trip::<v1::Cancel>(b),
        21 => round_trip::<v1::CancelAck>(b),
        _ => round_trip::<v1::Error>(b),
    }
});
