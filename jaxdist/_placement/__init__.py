"""Where values go: a strategy's arguments onto its mesh (`arguments`), and the results of
cross-replica operations onto their destination devices (`results`). Internal.
"""
