"""Model connectors at run time: `connector` (ModelConnector, what every generated model module
subclasses), `checks` (what it checks before anything moves) and `table` (the tables a generated
model module holds, and where each section of its object lies)."""
