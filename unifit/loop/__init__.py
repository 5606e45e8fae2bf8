"""The fit loop's records: events, the callback base, the context callbacks see, train state and progress, the dispatcher."""
