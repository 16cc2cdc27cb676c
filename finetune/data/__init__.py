"""The rows: finding and loading the data, its formats, and what each row must hold."""
