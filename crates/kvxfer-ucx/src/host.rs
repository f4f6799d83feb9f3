//! Whether a peer is on this host: decides if an endpoint may use shared memory (see
//! `UcxConfig::same_host_shared_memory`).
#![allow(unsafe_code)]

use std::net::IpAddr;
use std::ptr::null_mut;

/// Whether `ip` is a loopback or unspecified address, or an address of one of this host's
/// network interfaces (`getifaddrs`): a peer at it is on this host. Unlike a bind test, this
/// is not fooled by `net.ipv4.ip_nonlocal_bind`. An IPv6 address is compared without its
/// scope; a failure of `getifaddrs` answers "not this host" (the safe side: peer-failure
/// handling stays on).
pub fn is_local_address(ip: IpAddr) -> bool {
    if ip.is_loopback() || ip.is_unspecified() {
        return true;
    }
    let mut head: *mut libc::ifaddrs = null_mut();
    // SAFETY: getifaddrs writes the head of a list it allocated; freed below, once.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return false;
    }
    let mut found = false;
    let mut cur = head;
    while !cur.is_null() && !found {
        // SAFETY: `cur` is a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        let addr = ifa.ifa_addr;
        if !addr.is_null() {
            // SAFETY: a non-null ifa_addr points to a sockaddr at least as long as its family
            // says: sockaddr_in for AF_INET, sockaddr_in6 for AF_INET6.
            let family = i32::from(unsafe { (*addr).sa_family });
            found = match ip {
                IpAddr::V4(v4) if family == libc::AF_INET => {
                    // SAFETY: see above (AF_INET).
                    let sin = unsafe { &*addr.cast::<libc::sockaddr_in>() };
                    u32::from_be(sin.sin_addr.s_addr) == u32::from(v4)
                }
                IpAddr::V6(v6) if family == libc::AF_INET6 => {
                    // SAFETY: see above (AF_INET6).
                    let sin6 = unsafe { &*addr.cast::<libc::sockaddr_in6>() };
                    sin6.sin6_addr.s6_addr == v6.octets()
                }
                _ => false,
            };
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: the list getifaddrs returned, not used after this.
    unsafe { libc::freeifaddrs(head) };
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_and_this_hosts_addresses_are_local_others_are_not() {
        assert!(is_local_address("127.0.0.1".parse().expect("ip")));
        assert!(is_local_address("::1".parse().expect("ip")));
        assert!(is_local_address("0.0.0.0".parse().expect("ip")));
        // Documentation addresses (RFC 5737, 3849) no interface here has.
        for doc in ["198.51.100.77", "203.0.113.9", "2001:db8::77"] {
            assert!(!is_local_address(doc.parse().expect("ip")), "{doc}");
        }
        // The address this host routes from is one of its own (skipped without a route).
        let probe = std::net::UdpSocket::bind("0.0.0.0:0").expect("bind");
        if probe.connect("198.51.100.1:9").is_ok() {
            let own = probe.local_addr().expect("local addr").ip();
            assert!(is_local_address(own), "{own}");
        }
    }
}
