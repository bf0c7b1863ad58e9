"""Where the VMs live: a dedicated private VPC, or an existing network, plus the firewall.

Dedicated: a custom-mode VPC, one subnet with Private Google Access and flow logs, a Cloud Router
and Cloud NAT for egress. VMs never get external IPs either way. The firewall admits only
Google's health checkers to the health port and, optionally, IAP to SSH, on the trainer's tag;
nothing is open to 0.0.0.0/0. A pool adds one rule: every TCP port (the rendezvous port and the
collectives' ephemeral ports) from the experiment's service account to the same account only.
Optionally, a DNS policy logs every query the network's VMs make (`DnsQueryLogging`). On a shared
VPC, the service project's Google APIs service agent may get Network User on the host subnetwork
(`SharedVpcNetworkUser`): the group creates its VMs as that agent.
"""

from __future__ import annotations

from dataclasses import dataclass

from cdktn_provider_google.compute_firewall import (
    ComputeFirewall,
    ComputeFirewallAllow,
    ComputeFirewallLogConfig,
)
from cdktn_provider_google.compute_network import ComputeNetwork
from cdktn_provider_google.compute_router import ComputeRouter
from cdktn_provider_google.compute_router_nat import ComputeRouterNat, ComputeRouterNatLogConfig
from cdktn_provider_google.compute_subnetwork import ComputeSubnetwork, ComputeSubnetworkLogConfig
from cdktn_provider_google.compute_subnetwork_iam_member import ComputeSubnetworkIamMember
from cdktn_provider_google.data_google_project import DataGoogleProject
from cdktn_provider_google.dns_policy import DnsPolicy, DnsPolicyNetworks
from constructs import Construct

from stacks import gcp_rules as R


@dataclass(frozen=True)
class NetworkProps:
    project: str
    region: str
    name: str  # prefix of every resource name
    dedicated: bool
    subnet_cidr: str = "10.20.0.0/24"
    existing_network: str | None = None
    existing_subnetwork: str | None = None
    subnetwork_project: str | None = None


class TrainerNetwork(Construct):
    """Exposes `network` (for firewall rules) and `subnetwork` (for the template)."""

    def __init__(self, scope: Construct, id_: str, props: NetworkProps) -> None:
        super().__init__(scope, id_)
        self.subnetwork_project: str | None = None
        if props.dedicated:
            vpc = ComputeNetwork(
                self,
                "vpc",
                project=props.project,
                name=f"{props.name}-vpc",
                auto_create_subnetworks=False,
                routing_mode="REGIONAL",
                description="spottrain: private network for the trainer VMs",
            )
            subnet = ComputeSubnetwork(
                self,
                "subnet",
                project=props.project,
                region=props.region,
                name=f"{props.name}-subnet",
                network=vpc.id,
                ip_cidr_range=props.subnet_cidr,
                # Google APIs (GCS, logging, metadata) without external IPs.
                private_ip_google_access=True,
                log_config=ComputeSubnetworkLogConfig(
                    aggregation_interval="INTERVAL_10_MIN", flow_sampling=0.5,
                    metadata="INCLUDE_ALL_METADATA",
                ),
            )
            router = ComputeRouter(
                self, "router", project=props.project, region=props.region,
                name=f"{props.name}-router", network=vpc.id,
            )
            ComputeRouterNat(
                self,
                "nat",
                project=props.project,
                region=props.region,
                name=f"{props.name}-nat",
                router=router.name,
                nat_ip_allocate_option="AUTO_ONLY",
                source_subnetwork_ip_ranges_to_nat="ALL_SUBNETWORKS_ALL_IP_RANGES",
                log_config=ComputeRouterNatLogConfig(enable=True, filter="ERRORS_ONLY"),
            )
            self.network: str = vpc.name
            self.network_ref: str = vpc.id
            self.subnetwork: str = subnet.id
        else:
            assert props.existing_network and props.existing_subnetwork  # validated upstream
            host = props.subnetwork_project or props.project
            self.network = props.existing_network
            self.network_ref = f"projects/{host}/global/networks/{props.existing_network}"
            self.subnetwork = props.existing_subnetwork
            self.subnetwork_project = host


@dataclass(frozen=True)
class FirewallProps:
    project: str
    name: str
    network: str
    target_tag: str
    health_port: int
    iap_ssh: bool


class TrainerFirewall(Construct):
    def __init__(self, scope: Construct, id_: str, props: FirewallProps) -> None:
        super().__init__(scope, id_)
        log = ComputeFirewallLogConfig(metadata="INCLUDE_ALL_METADATA")
        ComputeFirewall(
            self,
            "health-check",
            project=props.project,
            name=f"{props.name}-allow-health-check",
            network=props.network,
            direction="INGRESS",
            description="Google health checkers to the trainer's health port only",
            source_ranges=list(R.HEALTH_CHECK_RANGES),
            target_tags=[props.target_tag],
            allow=[ComputeFirewallAllow(protocol="tcp", ports=[str(props.health_port)])],
            log_config=log,
        )
        if props.iap_ssh:
            ComputeFirewall(
                self,
                "iap-ssh",
                project=props.project,
                name=f"{props.name}-allow-iap-ssh",
                network=props.network,
                direction="INGRESS",
                description="SSH through Identity-Aware Proxy only",
                source_ranges=[R.IAP_RANGE],
                target_tags=[props.target_tag],
                allow=[ComputeFirewallAllow(protocol="tcp", ports=["22"])],
                log_config=log,
            )


@dataclass(frozen=True)
class PoolFirewallProps:
    project: str
    name: str
    network: str
    service_account_email: str


class PoolFirewall(Construct):
    """A pool's nodes talk to each other, and to nothing else: the rendezvous (TCPStore) and the
    collectives (gloo/NCCL bootstrap and data on ephemeral ports, so every TCP port) between VMs
    that run as the experiment's service account, identified by account rather than by tag (a
    tag can be set by anyone who can edit an instance; the account needs actAs)."""

    def __init__(self, scope: Construct, id_: str, props: PoolFirewallProps) -> None:
        super().__init__(scope, id_)
        self.rule = ComputeFirewall(
            self,
            "pool",
            project=props.project,
            name=f"{props.name}-allow-pool",
            network=props.network,
            direction="INGRESS",
            description="Rendezvous and collectives between this experiment's nodes only",
            source_service_accounts=[props.service_account_email],
            target_service_accounts=[props.service_account_email],
            allow=[ComputeFirewallAllow(protocol="tcp")],
            log_config=ComputeFirewallLogConfig(metadata="INCLUDE_ALL_METADATA"),
        )


@dataclass(frozen=True)
class DnsQueryLoggingProps:
    project: str  # the network's project (the host project of a shared VPC)
    name: str
    network: str  # id or URL of the network


class DnsQueryLogging(Construct):
    """A Cloud DNS server policy with query logging on the network: every lookup its VMs make
    (the pool's rendezvous name included) goes to Cloud Logging. A network takes one policy, so
    the stack adds it only to a network it owns unless the experiment asks
    (`network.dns_query_logging`)."""

    def __init__(self, scope: Construct, id_: str, props: DnsQueryLoggingProps) -> None:
        super().__init__(scope, id_)
        self.policy = DnsPolicy(
            self,
            "policy",
            project=props.project,
            name=f"{props.name}-dns-logging",
            description="spottrain: log the DNS queries of the experiment's VMs",
            enable_logging=True,
            enable_inbound_forwarding=False,
            networks=[DnsPolicyNetworks(network_url=props.network)],
        )


#: The role the group's VM creator needs on a shared VPC's subnetwork.
NETWORK_USER = "roles/compute.networkUser"


@dataclass(frozen=True)
class SharedVpcNetworkUserProps:
    project: str  # the service project (the experiment's)
    host_project: str
    region: str
    subnetwork: str  # name in the host project


class SharedVpcNetworkUser(Construct):
    """Network User on the host subnetwork for the service project's Google APIs service agent
    (`PROJECT_NUMBER@cloudservices.gserviceaccount.com`, the identity a managed instance group
    creates VMs as). The project number comes from the project itself (a data source). Without
    the grant the group silently creates no VM: `list_errors_command` shows why."""

    def __init__(self, scope: Construct, id_: str, props: SharedVpcNetworkUserProps) -> None:
        super().__init__(scope, id_)
        project = DataGoogleProject(self, "service-project", project_id=props.project)
        self.grant = ComputeSubnetworkIamMember(
            self,
            "network-user",
            project=props.host_project,
            region=props.region,
            subnetwork=props.subnetwork,
            role=NETWORK_USER,
            member=f"serviceAccount:{project.number}@cloudservices.gserviceaccount.com",
        )
