"""`[budget]`: a Cloud Billing budget on what the experiment's resources cost, with alert
thresholds (cloud.google.com/billing/docs/how-to/budgets; the `google_billing_budget` resource).

The budget filters the billing account's costs by the experiment's label (`spottrain-experiment`,
on every resource the stack creates) within its project, over a calendar period, and alerts at
each threshold of `amount_usd` (spent, and, with `forecast`, forecast to be spent), by email to the
account's billing administrators and to the `[alerts]` email channels (at most 5: the Budget API
takes email channels only, so a webhook or Pub/Sub channel hears the alerts, not the budget).
The amount's currency is left to the billing account unless `currency_code` is set: the API
refuses any currency but the account's (cloud.google.com/billing/docs/reference/budget/rest/v1/
billingAccounts.budgets#Budget: "currencyCode ... must match the currency of the billing account"). Only costs of
labelled resources count: VMs, disks and the bucket; not Cloud Logging and Monitoring, whose
entries carry no resource label (`make cost` prices those separately).

The Billing Budget API refuses user credentials without a quota project ("billingbudgets.googleapis.com
requires a quota project"): the budget is created through a provider alias that bills its calls to
the experiment's project (`billing_project`, `user_project_override`), where the stack enables the
API. Creating it needs Billing Account Administrator or Costs Manager on the account.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cdktn_provider_google.billing_budget import BillingBudget, BillingBudgetThresholdRules
from cdktn_provider_google.data_google_project import DataGoogleProject
from cdktn_provider_google.provider import GoogleProvider
from constructs import Construct

from stacks.experiment import Budget

#: Budget notifications reach at most this many Monitoring channels (the API's limit).
MAX_CHANNELS = 5


@dataclass(frozen=True)
class BudgetProps:
    project: str
    name: str
    budget: Budget
    channels: list[str] = field(default_factory=list)  # email notification channels' names


class RunBudget(Construct):
    def __init__(self, scope: Construct, id_: str, props: BudgetProps) -> None:
        super().__init__(scope, id_)
        b = props.budget
        provider = GoogleProvider(self, "billing-provider", alias="billing", project=props.project,
                                  billing_project=props.project, user_project_override=True)
        number = DataGoogleProject(self, "project", project_id=props.project).number
        rules = [BillingBudgetThresholdRules(threshold_percent=t, spend_basis="CURRENT_SPEND") for t in b.thresholds]
        if b.forecast:
            rules.append(BillingBudgetThresholdRules(threshold_percent=1.0, spend_basis="FORECASTED_SPEND"))
        self.budget = BillingBudget(
            self, "budget", provider=provider, billing_account=b.billing_account,
            display_name=f"spottrain {props.name}",
            amount={"specified_amount": {"units": str(b.amount_usd)}
                    | ({"currency_code": b.currency_code} if b.currency_code else {})},
            budget_filter={"projects": [f"projects/{number}"], "labels": {"spottrain-experiment": props.name},
                           "calendar_period": b.period.upper(), "credit_types_treatment": "INCLUDE_ALL_CREDITS"},
            threshold_rules=rules,
            all_updates_rule={"monitoring_notification_channels": props.channels[:MAX_CHANNELS]}
            if props.channels else None)
