"""The relay: a request's body read and bounded, sent to the engine it was admitted to, its answer
or failure sent back."""
