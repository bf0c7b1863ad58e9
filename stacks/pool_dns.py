"""A pool's stable rendezvous name: a private Cloud DNS zone on the experiment's network and one A
record, `coordinator.<experiment>.spottrain.internal`, pointing at the coordinator's static IP.

Private: the zone answers only inside the bound network (dns.googleapis.com is enabled by the
stack's API list). A private zone takes no `cloud_logging_config` (public zones only: the API
refuses it); query logging for private names is a DNS policy on the network
(`stacks.network.DnsQueryLogging`), on by default for a pool on a dedicated network.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cdktn_provider_google.dns_managed_zone import (
    DnsManagedZone,
    DnsManagedZonePrivateVisibilityConfig,
    DnsManagedZonePrivateVisibilityConfigNetworks,
)
from cdktn_provider_google.dns_record_set import DnsRecordSet
from constructs import Construct

#: Seconds resolvers keep the answer: the IP is static, but a short TTL costs nothing here.
TTL_S = 60


@dataclass(frozen=True)
class PoolDnsProps:
    project: str
    zone_name: str  # the managed zone's resource name
    domain: str  # "<experiment>.spottrain.internal." (trailing dot)
    host: str  # "coordinator.<experiment>.spottrain.internal" (no trailing dot)
    network: str  # id or URL of the network the zone is visible in
    address: str  # the coordinator's static internal IP
    labels: dict[str, str] = field(default_factory=dict)


class PoolDns(Construct):
    def __init__(self, scope: Construct, id_: str, props: PoolDnsProps) -> None:
        super().__init__(scope, id_)
        self.zone = DnsManagedZone(
            self,
            "zone",
            project=props.project,
            name=props.zone_name,
            dns_name=props.domain,
            description="spottrain: the pool's private names (the rendezvous host)",
            visibility="private",
            private_visibility_config=DnsManagedZonePrivateVisibilityConfig(
                networks=[DnsManagedZonePrivateVisibilityConfigNetworks(
                    network_url=props.network)]),
            labels=props.labels,
        )
        self.record = DnsRecordSet(
            self,
            "coordinator",
            project=props.project,
            managed_zone=self.zone.name,
            name=f"{props.host}.",
            type="A",
            ttl=TTL_S,
            rrdatas=[props.address],
        )
