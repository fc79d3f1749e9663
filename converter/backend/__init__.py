"""The converter's back end: the verification of the written file
through the runtime, and the report."""
