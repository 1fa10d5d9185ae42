"""Fuzz tests (hypothesis): router, layout, expert ops and losses against the references over
random shapes, dtypes and values; profiles and shared code in helpers/fuzz.py."""
