"""Factual error rate: closed-book QA graded without a judge (`closed_book`), and grounded
report generation whose numbers and names are checked against a seeded fact table
(`grounded`)."""
