"""Reports: render what a search or a job produced (Markdown, JSON, PNG)."""
