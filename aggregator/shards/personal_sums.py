"""How shards sum a job whose devices keep a personal part and report on it (FedSim/FedAlt, ``pp``):
FedAvg's round sums of the shared tensors (``fedavg_sums.py``), and a receipt that carries the
update's held-out report as well, so the coordinator's job keeps each device's latest report and
reports the same held-out WMA as one aggregator (``aggregator/jobs/personal_wma.py``)."""

from __future__ import annotations

from aggregator.shards.fedavg_sums import FedAvgRoundSums

HELDOUT = "heldout"         # the receipt's (n_test, correct, correct_global)


class PersonalRoundSums(FedAvgRoundSums):
    """FedAvg's round sums (the personal part never leaves the device: the update holds the shared
    tensors only); a receipt's held-out counts are recorded with the update's sample count."""

    def receipt(self, job, payload) -> dict:
        report = payload.update.report
        return {**super().receipt(job, payload),
                HELDOUT: [int(report.n_test), int(report.correct), int(report.correct_global)]}

    def record(self, job, device: str, receipt: dict) -> None:
        super().record(job, device, receipt)
        job.record_heldout(device, *(int(x) for x in receipt[HELDOUT]))
